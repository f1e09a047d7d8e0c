"""Single-request decode as the context grows, beside llama.cpp on the same GGUF.

native_kernels.py times one request's decode after a 128-token prompt, where the weights are all a step
reads. Chat turns, RAG answers and agent loops decode after thousands of tokens, and there every step
also reads the whole context's keys and values from the pool (30 layers x 3 KV heads x 64 dims x 2 x 4
bytes = 46 KB a token in float32: 92 MB a step at 2,000 tokens, about the weights' size). This runs the
same 64-token greedy decode after prompts of --contexts tokens (the prefixes of the 2,048-token prefill
workload) for kvserve (exact and int8 activations, native Q4_1 weights), optionally kvserve with the
native kernels of another git revision (`--before REV`: same Python, that revision's csrc/), and
llama-cpp-python; every runner once per round and context, in turn; medians.

    python benchmarks/long_decode.py                       # ~3 minutes on 2 idle cores
    python benchmarks/long_decode.py --before 94f32b9      # and the kernels before the decode prefetch

Writes benchmarks/results/long_decode.md (or --out) and docs/long_decode.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import line_plot, load_workloads, markdown_table, write_result  # noqa: E402
from native_kernels import (  # noqa: E402
    VARIANTS,
    KvserveRunner,
    build_revision,
    llama_cpp_python_runner,
    load_average,
)

ROOT = Path(__file__).resolve().parent.parent
NAMES = ("kvserve native Q4_1", "kvserve native Q4_1 int8")


def runners_for(before: str | None, workdir: Path, notes: list[str]) -> list:
    runners: list = [KvserveRunner(name, VARIANTS[name]) for name in NAMES]
    if before:
        library = build_revision(before, workdir)
        runners += [KvserveRunner(f"{name} (kernels of {before})", VARIANTS[name], library) for name in NAMES]
    return runners + llama_cpp_python_runner(notes)


def measure(runners: list, prompts: dict[int, list[int]], rounds: int, new: int) -> dict[str, dict[int, float]]:
    samples = {runner.name: {size: [] for size in prompts} for runner in runners}
    for runner in runners:
        runner.decode(prompts[min(prompts)], 8)  # warm-up
    for round_index in range(rounds):
        for size, prompt in prompts.items():
            for runner in runners:
                samples[runner.name][size].append(runner.decode(prompt, new))
            print(f"round {round_index + 1}, {size} tokens: "
                  + ", ".join(f"{name} {values[size][-1]:.1f}" for name, values in samples.items()), flush=True)
    return {name: {size: statistics.median(v) for size, v in by_size.items()} for name, by_size in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="128,512,1024,2000", help="prompt lengths (tokens), at most 2,048")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=64, help="tokens decoded after each prompt")
    parser.add_argument("--before", metavar="REV", help="also kvserve with the native kernels of git REV")
    parser.add_argument("--out", default="long_decode", help="results/OUT.md and docs/OUT.png")
    args = parser.parse_args()
    long_prompt = load_workloads()["prefill"]["2048"]
    prompts = {int(size): long_prompt[: int(size)] for size in args.contexts.split(",")}
    notes = [f"Load average (1 / 5 / 15 min) before: {load_average()}."]
    with tempfile.TemporaryDirectory() as workdir:
        runners = runners_for(args.before, Path(workdir), notes)
        median = measure(runners, prompts, args.rounds, args.new)
    notes.append(f"Load average after: {load_average()}. {args.rounds} rounds; {args.new} greedy tokens after each "
                 f"prompt (decode tok/s = (new - 1) / (total - TTFT)); threads: {torch.get_num_threads()}; prompts: "
                 "prefixes of the 2,048-token prefill workload; every runner once per round and context, in turn; "
                 "kvserve's pool 1 GiB float32.")
    peer = "llama.cpp (llama-cpp-python)"
    header = ["runner", *(f"{size} tokens" for size in prompts)]
    rows = [[name, *by_size.values()] for name, by_size in median.items()]
    if peer in median:
        rows += [[f"{name} / llama.cpp", *(by_size[s] / median[peer][s] for s in prompts)]
                 for name, by_size in median.items() if name != peer]
    picture = ROOT / "docs" / f"{args.out}.png"
    line_plot(median, picture, "context (prompt tokens) before the decode", "decode tok/s, one request")
    notes.append(f"![decode tok/s against context](docs/{picture.name})")
    table = markdown_table(header, rows)
    write_result(args.out, "Single-request decode as the context grows, beside llama.cpp", table, "\n\n".join(notes))
    print(table)


if __name__ == "__main__":
    main()
