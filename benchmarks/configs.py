"""Every configuration against float32 on the CPU at hand: no configuration may be more than 2x slower.

Runs each (weights, dtype, activations, kernels) combination a user can ask for on the default model --
single-request decode, prefill of 512 tokens, batch 8 (64-token prompts, 32 new tokens each) -- interleaved
round by round (median of --rounds), and divides each by the float32 run with the same weights and kernels:
dense by dense fp32 (the transformers-exact reference), native by native fp32; the torch kernels (no
compiler) by dense fp32 on the torch kernels, which is what they run a GGUF's blocks as. Records the CPU
model and its vector features, since that is what decides it: without native bf16 (no avx512_bf16 / AMX)
`--dtype bfloat16` keeps weights in bf16 and computes in fp32 (kernels/ops.py `stores_bf16`); with it, bf16
runs natively.

    python benchmarks/configs.py              # ~5 minutes on 2 cores
    python benchmarks/configs.py --rounds 1   # one round
    python benchmarks/configs.py --out configs_amx   # another CPU's section beside the first
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_workloads, markdown_table, write_result  # noqa: E402
from native_kernels import KvserveRunner  # noqa: E402

CONFIGS = {  # name -> (LLM arguments, the fp32 configuration it is compared with)
    "dense fp32": ({"weights": "dense"}, "dense fp32"),
    "dense bf16": ({"weights": "dense", "dtype": "bfloat16"}, "dense fp32"),
    "dense fp32, torch kernels": ({"weights": "dense", "kernels": "torch"}, "dense fp32"),
    "native Q4_1 fp32": ({"weights": "native"}, "native Q4_1 fp32"),
    "native Q4_1 bf16": ({"weights": "native", "dtype": "bfloat16"}, "native Q4_1 fp32"),
    "native Q4_1 int8": ({"weights": "native", "activation_quant": "int8"}, "native Q4_1 fp32"),
    "native Q4_1 fp32, bf16 KV": ({"weights": "native", "kv_cache_dtype": "bfloat16"}, "native Q4_1 fp32"),
    "native Q4_1 int8, bf16 KV + attention": ({"weights": "native", "activation_quant": "int8",
                                               "kv_cache_dtype": "bfloat16", "attention_dtype": "bfloat16"},
                                              "native Q4_1 fp32"),
    "native Q4_1 bf16 KV + attention, torch kernels": ({"weights": "native", "kernels": "torch",
                                                        "kv_cache_dtype": "bfloat16", "attention_dtype": "bfloat16"},
                                                       "dense fp32, torch kernels"),
    "native Q4_1, torch kernels": ({"weights": "native", "kernels": "torch"}, "dense fp32, torch kernels"),
}
FIGURES = ("decode", "prefill512", "batch8")
TARGET = 2.0  # no configuration more than this many times slower than its fp32


def measure(runner: KvserveRunner, workloads: dict) -> dict[str, float]:
    decode = workloads["decode_single"]
    prompts = [[(7 * j + i) % 40000 + 100 for i in range(64)] for j in range(8)]
    return {
        "decode": runner.decode(decode["prompt"], 32),
        "prefill512": runner.prefill(workloads["prefill"]["512"]),
        "batch8": runner.batch(prompts, 32),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="configs", metavar="NAME",
                        help="write benchmarks/results/NAME.md (one section per CPU measured)")
    args = parser.parse_args()
    workloads = load_workloads()
    samples: dict[str, dict[str, list[float]]] = {name: {f: [] for f in FIGURES} for name in CONFIGS}
    for round_index in range(args.rounds):
        for name, (config, _) in CONFIGS.items():
            print(f"[configs] round {round_index + 1}/{args.rounds}: {name}", flush=True)
            runner = KvserveRunner(name, config)
            runner.prefill(workloads["prefill"]["128"])  # warm-up
            for figure, value in measure(runner, workloads).items():
                samples[name][figure].append(value)
            del runner
    median = {name: {f: statistics.median(v) for f, v in figures.items()} for name, figures in samples.items()}
    rows, worst = [], {}
    for name, (_, base) in CONFIGS.items():
        ratios = [median[base][f] / median[name][f] for f in FIGURES]
        worst[name] = max(ratios)
        rows.append([name, *(median[name][f] for f in FIGURES), base, *ratios,
                     "yes" if worst[name] <= TARGET else "**no**"])
    header = ["configuration", "decode tok/s", "prefill 512 tok/s", "batch 8 tok/s", "compared with",
              "decode slower by", "prefill slower by", "batch 8 slower by", f"within {TARGET:g}x"]
    failing = [name for name, ratio in worst.items() if ratio > TARGET]
    notes = (f"Median of {args.rounds} interleaved rounds; 'slower by' = the fp32 configuration's figure / this "
             "one's (below 1: faster). Batch 8: 64-token prompts, 32 new tokens each, prefill included. "
             + (f"Over {TARGET:g}x: {', '.join(failing)}." if failing else f"Every configuration within {TARGET:g}x."))
    table = markdown_table(header, rows)
    title = "Every configuration against float32 on this CPU" + ("" if args.out == "configs" else f" ({args.out})")
    write_result(args.out, title, table, notes)
    print(table + "\n\n" + notes)


if __name__ == "__main__":
    main()
