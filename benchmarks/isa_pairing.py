"""Which of the native kernels' two code paths runs faster on this CPU: AVX-512 against AVX2, whole engine.

The library holds both (csrc/kernels.cpp compiles the kernel bodies once per ISA) and picks the widest the
CPU has. On an Intel CPU the AVX-512 path is the faster one; on a Zen 4, whose AVX-512 units are 256 bits
wide (a 512-bit instruction takes both halves), the answer was not measured before this script. Each
runner is a whole `LLM` on the default model, native Q4_1 weights, exact (float32) and int8 activations,
built with `KVSERVE_ISA` set to its path; every figure of benchmarks/native_kernels.py (single-request decode,
batch 8 / 32, prefill 512 / 2,048, 16 requests sharing a 1,900-token prefix) is measured runner after runner,
figure by figure, `--rounds` times, so load on the shared machine hits all alike; medians.

    python benchmarks/isa_pairing.py             # about 4 minutes on 2 cores
    python benchmarks/isa_pairing.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_workloads, markdown_table, write_result  # noqa: E402
from kvserve.kernels.ops import ISA_ENV  # noqa: E402
from native_kernels import VARIANTS, KvserveRunner, figures  # noqa: E402

FIGURES = ("decode", "batch8", "batch32", "prefill512", "prefill2048", "shared")
HEADER = ["runner", "decode tok/s", "batch 8 tok/s", "batch 32 tok/s", "prefill 512 tok/s", "prefill 2048 tok/s",
          "shared prefix s"]


def runner(variant: str, isa: str) -> KvserveRunner:
    """An LLM whose kernels take the `isa` path (the variable is read when the engine builds its kernels)."""
    previous = os.environ.get(ISA_ENV)
    os.environ[ISA_ENV] = isa
    try:
        built = KvserveRunner(f"{variant} ({isa})", VARIANTS[variant])
    finally:
        if previous is None:
            os.environ.pop(ISA_ENV, None)
        else:
            os.environ[ISA_ENV] = previous
    if built.llm.engine.model.kernels.native.isa != isa:
        raise SystemExit(f"{isa} is not available on this CPU")
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new", type=int, default=32, help="new tokens per decode / batch request")
    args = parser.parse_args()
    workloads = load_workloads()
    runners = [runner(variant, isa) for variant in ("kvserve native Q4_1", "kvserve native Q4_1 int8")
               for isa in ("avx512", "avx2")]
    rounds = [figures(runners, workloads, args.new) for _ in range(args.rounds)]
    median = {r.name: {key: statistics.median(one[r.name][key] for one in rounds) for key in FIGURES}
              for r in runners}
    rows = [[name, *(values[key] for key in FIGURES)] for name, values in median.items()]
    ratio_rows = []
    for variant in ("kvserve native Q4_1", "kvserve native Q4_1 int8"):
        wide, narrow = median[f"{variant} (avx512)"], median[f"{variant} (avx2)"]
        ratio_rows.append([f"{variant}: avx2 / avx512"]
                          + [narrow[key] / wide[key] for key in FIGURES[:-1]] + [wide["shared"] / narrow["shared"]])
    table = (markdown_table(HEADER, rows) + "\n\nRatios (above 1: the AVX2 path is faster; shared prefix as a time "
             "ratio):\n\n" + markdown_table(["", *HEADER[1:]], ratio_rows))
    notes = (f"Medians of {args.rounds} rounds; {args.new} new tokens per decode and batch request; every runner "
             "measured once per figure per round, in turn.")
    write_result("isa_pairing", "The native kernels' AVX-512 and AVX2 paths on this CPU", table, notes)
    print(table)


if __name__ == "__main__":
    main()
