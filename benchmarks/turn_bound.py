"""The seed's chat turn against this CPU's arithmetic: the fastest its attention could run, measured.

Issue 12's example: 100 new tokens after 1,900 cached ones should reach their first token within 1.2x the
time of the same 100 tokens alone. The turn does all the work of the 100 tokens alone plus attention of its
100 queries over ~2,000 keys: per layer, query head and key, one multiply-add per head dimension for the
score and one for the value -- 6.7 G multiply-adds over SmolLM2's 30 layers x 9 heads x 64 dims -- and one
exponential per (query head, key): 54 M. Nothing about the cache makes that work smaller: every query must
see every cached key for the output to stay exact (or, with bf16 products, the same rounded one).

This puts the measured turn beside its floor. The floor takes the CPU's own peak rate of the instruction
that does the configuration's attention multiply-adds (fp_rate.py's loop: 12 independent chains per thread,
2 threads) -- a 512-bit FMA (16 multiply-adds) for float32 products, AVX512-BF16's vdpbf16ps (32) for
`--attention-dtype bfloat16`; 256-bit FMAs where there is no AVX-512 -- and adds nothing for exponentials,
loads, reductions or the softmax: floor ratio = (alone + multiply-adds / peak rate) / alone. Where that is
above 1.2 on a CPU, no kernel meets the target there without the 100 tokens alone getting slower. The floor
is generous: the turn also recomputes the history's partial last block (1,900 = 118 x 16 + 12 tokens: only
full blocks are cached), 12% more rows through the matmuls than the 100 tokens alone, left out here.

Each configuration runs in this process one after the other: the turn (`source_ab.turn_ttft`) and the 100
tokens alone in a fresh cache namespace, alternately, --rounds times; best of each.

    python benchmarks/turn_bound.py                  # ~1 minute on 2 idle cores
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_workloads, markdown_table, write_result  # noqa: E402
from fp_rate import OPS, OPS_512, build, rates_512  # noqa: E402
from native_kernels import FAST, VARIANTS, KvserveRunner  # noqa: E402

CONFIGS = {"kvserve native Q4_1": "float32", FAST: "bfloat16"}  # the exact default, the fastest configuration
LAYERS, HEADS, HEAD_DIM = 30, 9, 64  # SmolLM2-135M


def attention_macs(history: int, new: int) -> int:
    """Multiply-adds of the new tokens' attention: query i sees history + i + 1 keys, two products a key."""
    keys = sum(history + i + 1 for i in range(new))
    return keys * LAYERS * HEADS * HEAD_DIM * 2


def peak_rates(iterations: int, passes: int) -> dict[str, tuple[float, str]]:
    """This CPU's best multiply-adds per ns with 2 threads, by attention products, and the instruction."""
    with tempfile.TemporaryDirectory() as workdir:
        lib = build(Path(workdir))
        wide = rates_512(lib, iterations, passes, threads=2)
        fma = ((wide[0] * OPS_512[0][1], OPS_512[0][0]) if 0 in wide  # else fp_rate's 256-bit FMA row
               else (max(lib.op_rate(0, iterations, 2) for _ in range(passes)) * OPS[0][1] / 2, OPS[0][0]))
    # without AVX512-BF16 the bf16 products run as float32 FMAs on the rounded values
    return {"float32": fma, "bfloat16": (wide[1] * OPS_512[1][1], OPS_512[1][0]) if 1 in wide else fma}


def measure(name: str, history: list[int], new: list[int], rounds: int) -> tuple[float, float]:
    """Best seconds of the turn and of the new tokens alone."""
    runner = KvserveRunner(name, VARIANTS[name])
    runner.turn(history, new)
    runner.prefill(new)  # warm-up
    turns, alone = [], []
    for round_index in range(rounds):
        turns.append(runner.turn(history, new))
        alone.append(len(new) / runner.prefill(new))
        print(f"{name}, round {round_index + 1}: turn {1e3 * turns[-1]:.1f} ms, alone {1e3 * alone[-1]:.1f} ms",
              flush=True)
    return min(turns), min(alone)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=50_000_000, help="per rate measurement (fp_rate.py's)")
    parser.add_argument("--passes", type=int, default=3, help="best of this many rate measurements")
    parser.add_argument("--out", default="turn_bound")
    args = parser.parse_args()
    shared = load_workloads()["shared_prefix"]
    history, new = shared["prefix"], shared["suffixes"][0]
    macs = attention_macs(len(history), len(new))
    peaks = peak_rates(args.iterations, args.passes)
    rows = []
    for name, products in CONFIGS.items():
        rate, instruction = peaks[products]
        turn, alone = measure(name, history, new, args.rounds)
        floor = macs / rate / 1e9
        rows.append([name, f"{1e3 * alone:.1f}", f"{1e3 * turn:.1f}", f"{turn / alone:.2f}",
                     f"{instruction}: {rate:.0f} G/s", f"{1e3 * floor:.1f}", f"{(alone + floor) / alone:.2f}",
                     f"{1e3 * (turn - alone):.1f}", f"{floor / (turn - alone):.0%}"])
    table = markdown_table(
        ["configuration", "100 tokens alone ms", "turn ms", "turn / alone (target 1.2)",
         "peak multiply-adds (2 threads)", "attention floor ms", "floor turn / alone", "turn - alone ms",
         "floor / (turn - alone)"], rows)
    text = (f"{table}\n\nThe turn: {len(new)} new tokens after a {len(history):,}-token cached history "
            f"(the shared-prefix workload's); its attention: {macs / 1e9:.2f} G multiply-adds. Best of "
            f"{args.rounds} rounds; peak rates best of {args.passes}.")
    path = write_result(args.out, "The seed's chat turn against this CPU's arithmetic", text,
                        "Floor: the 100 tokens alone plus the attention's multiply-adds at the CPU's measured "
                        "peak rate, nothing else (benchmarks/turn_bound.py's docstring).")
    print(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
