"""The native kernels' scratch arena (csrc/scratch.h) against allocating per call: CPU time and minor page
faults of prefill and decode, with the kernels as built from another git revision (default `main`) and as
here, in one process on one model, alternating round by round (paired), one thread.

    python benchmarks/scratch_arena.py --before main --rounds 5

Workloads (smollm2-135m, native Q4_1/Q8_0 weights, prefix cache off so every round prefills again):
prefill (loop) -- 3 prompts of 500 tokens one after another, 1 token each (the C layer loop's 500-row
steps: its ~17 MiB buffer, qgemm's packed rows, prefill attention's tiles); prefill (Python loop) -- the
3 of 512 at once (one 1,536-row step: beyond the loop's 512, the Python loop dequantizes each weight for
torch's GEMM); decode 16 -- 16 short prompts x 32 greedy tokens
(16-row steps: layer_forward with qgemm); decode 1 -- one prompt x 32 tokens (decode_step.h's one region).
Both variants produce the same tokens (checked). Prints the median and best CPU seconds per workload.
`--mmap-threshold BYTES` pins glibc's mmap threshold first (server/heap.py's `fix_mmap_threshold`), for
the cost of pinning with and without the arena.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.kernels.native import NativeLibrary  # noqa: E402
from kvserve.server.heap import fix_mmap_threshold  # noqa: E402
from native_kernels import build_revision  # noqa: E402


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# name -> the generate calls of one measurement, each (prompts, params).
WORKLOADS = {
    "prefill 3 x 500 (loop)": [([[100 + (7 * i + j) % 20000 for i in range(500)]], greedy(1)) for j in range(3)],
    "prefill 1,536 rows (Python loop)": [([[100 + (7 * i + j) % 20000 for i in range(512)] for j in range(3)],
                                          greedy(1))],
    "decode 16 x 32": [([[50 + j, 60 + j, 70 + j] for j in range(16)], greedy(32))],
    "decode 1 x 32": [([[11, 22, 33, 44]], greedy(32))],
}


def timed(llm: LLM, calls: list[tuple[list[list[int]], SamplingParams]]) -> tuple[float, int, list[list[int]]]:
    """CPU seconds, minor page faults, and the tokens of the generate calls."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.process_time()
    outputs = [o for prompts, params in calls
               for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    spent = time.process_time() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return spent, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="main", help="git revision whose csrc/ is the baseline")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mmap-threshold", type=int, default=0, help="pin glibc's mmap threshold (bytes)")
    args = parser.parse_args()
    if args.mmap_threshold and not fix_mmap_threshold(args.mmap_threshold):
        raise SystemExit("could not pin the mmap threshold (not glibc, or MALLOC_MMAP_THRESHOLD_ set)")
    torch.set_num_threads(1)
    llm = LLM("smollm2-135m", progress=False, kv_cache_memory="128MiB", kernels="native", weights="native",
              prefix_cache="off")
    model = llm.engine.model
    with tempfile.TemporaryDirectory() as workdir:
        libraries = {f"before ({args.before})": NativeLibrary.load(build_revision(args.before, Path(workdir)),
                                                                   model.kernels.native.isa),
                     "arena (here)": model.kernels.native}
        for native in libraries.values():
            native.lib.kv_set_num_threads(1)
        results: dict[tuple[str, str], list[tuple[float, int]]] = {}
        tokens: dict[str, list[list[int]]] = {}
        for round_index in range(args.rounds + 1):  # round 0 warms both up and is not counted
            order = list(libraries.items()) if round_index % 2 == 0 else list(libraries.items())[::-1]
            for name, native in order:
                model.kernels.native = native
                model.layer_loop.native = native
                for workload, calls in WORKLOADS.items():
                    spent, faults, got = timed(llm, calls)
                    if tokens.setdefault(workload, got) != got:
                        raise SystemExit(f"{name}: {workload} generated other tokens than the other variant")
                    if round_index:
                        results.setdefault((name, workload), []).append((spent, faults))
            print(f"round {round_index} done", flush=True)
    pinned = f"mmap threshold pinned at {args.mmap_threshold}" if args.mmap_threshold else "dynamic mmap threshold"
    print(f"CPU seconds (median / best of {args.rounds} rounds, alternating), minor faults (median); 1 thread; "
          f"{pinned}")
    print("| workload | " + " | ".join(libraries) + " | arena / before (median) |")
    print("|---|" + "---|" * (len(libraries) + 1))
    for workload in WORKLOADS:
        cells, medians = [], []
        for name in libraries:
            runs = results[(name, workload)]
            median = statistics.median(s for s, _ in runs)
            medians.append(median)
            faults = statistics.median(f for _, f in runs)
            cells.append(f"{median:.3f} / {min(s for s, _ in runs):.3f} s, {faults:,.0f} faults")
        print(f"| {workload} | " + " | ".join(cells) + f" | {medians[1] / medians[0]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
