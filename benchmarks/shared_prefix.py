"""Sixteen requests sharing a 1,900-token prefix, sent at once, 32 new tokens each (benchmarks/data
"shared_prefix"), with the admission hold-back and cascade decode attention off and on.

Before: requests admitted in the same step each computed the whole prefix (nothing was cached until a
request's blocks were published), and every decode row read the whole 2k context itself. After: the
followers wait until the first request has published the prefix and take it as a cache hit
(engine/prefix_admission.py), and decodes read the shared blocks once per step as one group
(kv/cascade.py, kernels/csrc/cascade.h). Each variant is a fresh engine on the default model with its
native Q4_1 weights; outputs must agree token for token across variants.

    python benchmarks/shared_prefix.py               # three variants, a few minutes on 2 busy cores
    python benchmarks/shared_prefix.py --requests 8  # a reduced size
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Timer, load_workloads, markdown_table, write_result  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402

VARIANTS = {
    "before: hold off, cascade off": {"disable_prefix_hold": True, "disable_cascade_attn": True},
    "hold on, cascade off": {"disable_prefix_hold": False, "disable_cascade_attn": True},
    "hold on, cascade on (default)": {"disable_prefix_hold": False, "disable_cascade_attn": False},
}


def run_variant(flags: dict[str, bool], prompts: list[list[int]], new_tokens: int, threads: int) -> dict:
    llm = LLM("smollm2-135m", progress=False, kv_cache_memory="1GiB", max_num_seqs=64, kernels="native",
              weights="native", num_threads=threads, **flags)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    cpu_start = time.process_time()
    with Timer() as timer:
        outputs = llm.generate(prompts, params, cache_salt=str(time.perf_counter()), use_tqdm=False)
    cpu = time.process_time() - cpu_start
    cached = [out.num_cached_tokens for out in outputs]
    result = {
        "seconds": timer.seconds, "cpu_seconds": cpu, "cached": cached,
        "tokens": [out.outputs[0].token_ids for out in outputs],
        "ttft": statistics.mean(out.metrics.ttft for out in outputs),
    }
    del llm
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="how many of the 16 suffixes to send")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    shared = load_workloads()["shared_prefix"]
    prompts = [shared["prefix"] + suffix for suffix in shared["suffixes"][: args.requests]]
    results = {}
    for name, flags in VARIANTS.items():
        results[name] = run_variant(flags, prompts, args.new_tokens, args.threads)
        r = results[name]
        print(f"{name}: {r['seconds']:.1f} s wall, {r['cpu_seconds']:.1f} s CPU, cached {r['cached']}", flush=True)
    before = results[next(iter(VARIANTS))]
    rows = []
    for name, r in results.items():
        rows.append([
            name, r["seconds"], r["cpu_seconds"], before["seconds"] / r["seconds"], r["ttft"],
            sum(1 for c in r["cached"] if c == 0), f"{min(r['cached'])}-{max(r['cached'])}",
            "yes" if r["tokens"] == before["tokens"] else "NO",
        ])
    table = markdown_table(
        ["variant", "total s", "CPU s", "speed-up (wall)", "mean TTFT s", "requests with 0 cached",
         "cached tokens per request", "same tokens as before"], rows)
    notes = (
        f"{len(prompts)} requests (1,900-token prefix + 100-token suffixes), {args.new_tokens} new tokens each, "
        f"greedy, all sent at once; smollm2-135m with its native Q4_1 weights, {args.threads} threads. "
        "The machine is shared by several jobs: wall times are noisy (CPU s, the process's CPU time, is the "
        "steadier measure). Per-request cached tokens (after): "
        + ", ".join(str(c) for c in results[list(VARIANTS)[-1]]["cached"]) + "."
    )
    print(write_result("shared_prefix", "Shared-prefix batch: admission hold-back and cascade attention", table, notes))


if __name__ == "__main__":
    main()
