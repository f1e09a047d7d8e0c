"""Int8 activations (`--activation-quant int8`): decode throughput of the default model's Q4_1 GGUF with
fp32 activations and with int8 activation blocks, beside llama.cpp (llama-cpp-python) on the same file,
all in one run and interleaved figure by figure so every runner sees the same machine load.

Figures: one-request decode tok/s (128-token prompt, time after the first token); batch 8 and 32
(generated tokens / wall time, prefill included, as benchmarks/native_kernels.py counts them). Each figure is the
best of `--repeats` runs, the steadiest statistic on a shared machine.

    python benchmarks/int8.py            # about 3 minutes on 2 busy cores
    python benchmarks/int8.py --quick    # 32 new tokens instead of 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_workloads, markdown_table, write_result  # noqa: E402
from native_kernels import KvserveRunner, LlamaCppRunner  # noqa: E402

VARIANTS = {
    "kvserve Q4_1, fp32 activations": {"kernels": "native", "weights": "native"},
    "kvserve Q4_1, int8 activations": {"kernels": "native", "weights": "native", "activation_quant": "int8"},
}
FIGURES = ("decode", "batch8", "batch32")


def measure(runners: list, workloads: dict, new: int, repeats: int) -> dict[str, dict[str, float]]:
    tasks = {
        "decode": lambda r: r.decode(workloads["prefill"]["128"], new),
        "batch8": lambda r: r.batch(workloads["batch"]["8"]["prompts"], new),
        "batch32": lambda r: r.batch(workloads["batch"]["32"]["prompts"], new),
    }
    for runner in runners:
        runner.decode(workloads["prefill"]["128"], 8)  # warm-up
    results: dict[str, dict[str, float]] = {runner.name: {} for runner in runners}
    for key, task in tasks.items():
        for _ in range(repeats):
            for runner in runners:
                value = task(runner)
                results[runner.name][key] = max(results[runner.name].get(key, 0.0), value)
                print(f"{key:8s} {runner.name:34s} {value:9.2f}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 new tokens per sequence instead of 64")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    new = 32 if args.quick else 64
    runners = [KvserveRunner(name, variant) for name, variant in VARIANTS.items()]
    notes = []
    try:
        runners.append(LlamaCppRunner())
    except ImportError:
        notes.append("llama.cpp: not installed (`pip install -e .[bench]` builds llama-cpp-python).")
    results = measure(runners, load_workloads(), new, args.repeats)
    rows = [[name] + [figures[key] for key in FIGURES] for name, figures in results.items()]
    base = results["kvserve Q4_1, int8 activations"]
    ratios = [[f"int8 / {name}"] + [base[key] / figures[key] for key in FIGURES]
              for name, figures in results.items() if name != "kvserve Q4_1, int8 activations"]
    header = ["runner", "decode tok/s", "batch 8 tok/s", "batch 32 tok/s"]
    table = (markdown_table(header, rows) + "\n\nRatios (higher = int8 activations faster):\n\n"
             + markdown_table(["", "decode", "batch 8", "batch 32"], ratios))
    notes.append(f"{new} new tokens per sequence, best of {args.repeats}; threads: {torch.get_num_threads()}. "
                 "llama-cpp-python's API runs batch requests one at a time (its batched server is not measured "
                 "here).")
    write_result("int8", "Int8 activations vs fp32 activations and llama.cpp", table, "\n".join(notes))
    print(table)


if __name__ == "__main__":
    main()
