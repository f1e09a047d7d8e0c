"""Quantized matmuls by row count: where the wide GEMM (csrc/qgemm.h) beats the per-row kernel, and how
both compare with dequantize + torch's GEMM and with dense float32 weights (torch's GEMM, no dequantizing).

One layer of the default model (fused q/k/v 960x576, o 576x576, gate/up 3072x576, down 576x1536) in
random Q4_1 / Q8_0 blocks, x of M rows; ms per layer is the median of `--rounds` interleaved rounds (each
method measured once per round, so a burst of load on the shared machine hits all of them alike).
The crossovers `kernels/ops.py` dispatches on come from this table.

    python benchmarks/qgemm.py                 # about 2 minutes on 2 cores
    python benchmarks/qgemm.py --threads 1     # the kernels alone, without the second core's noise
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402

from kvserve.kernels import reference  # noqa: E402
from kvserve.kernels.ops import Kernels  # noqa: E402
from kvserve.kernels.quant import QTYPES, QuantWeight  # noqa: E402

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ROWS = (1, 4, 8, 12, 16, 32, 64, 128, 256, 512, 2048)


def random_quant(out_features: int, in_features: int, qtype: int, rng: np.random.Generator) -> QuantWeight:
    nb = in_features // 32
    scale = rng.uniform(-0.05, 0.05, (out_features, nb, 1)).astype(np.float16).view(np.uint8)
    if QTYPES[qtype][0] == "Q8_0":
        parts = [scale, rng.integers(-128, 128, (out_features, nb, 32), dtype=np.int8).view(np.uint8)]
    else:
        offset = rng.uniform(-0.2, 0.2, (out_features, nb, 1)).astype(np.float16).view(np.uint8)
        parts = [scale, offset, rng.integers(0, 256, (out_features, nb, 16), dtype=np.uint8)]
    blocks = np.concatenate(parts, axis=-1).reshape(out_features, -1)
    return QuantWeight(torch.from_numpy(np.ascontiguousarray(blocks)), qtype, in_features)


def measure(kernels: Kernels, qtype: int, rows: int, rounds: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    weights = [random_quant(n, k, qtype, rng) for n, k in LAYER]
    dense = [reference.dequantize(w).t().contiguous() for w in weights]
    xs = [torch.randn(rows, k) for _, k in LAYER]
    native = kernels.native
    methods = {
        "per-row qmatmul": lambda x, w, d: native.qmatmul(x, w.data, w.qtype, w.in_features),
        "wide qgemm": lambda x, w, d: native.qgemm(x, w.data, w.qtype, w.in_features),
        "dequantize + GEMM": lambda x, w, d: F.linear(x, kernels.dequantize(w)),
        "dense fp32 GEMM": lambda x, w, d: x @ d,
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):
        for name, method in methods.items():
            start = time.perf_counter()
            for x, w, d in zip(xs, weights, dense, strict=True):
                method(x, w, d)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = Kernels.create("native")
    if kernels.native is None:
        raise SystemExit("the native kernels are unavailable on this machine")
    table = []
    for qtype in (3, 8):
        for rows in (int(r) for r in args.rows.split(",")):
            ms = measure(kernels, qtype, rows, max(3, args.rounds if rows <= 512 else args.rounds // 2))
            best = min(ms, key=ms.get)
            table.append([QTYPES[qtype][0], rows, *ms.values(), best])
            print(table[-1], flush=True)
    header = ["weights", "rows", *[f"{name} ms" for name in ("per-row qmatmul", "wide qgemm", "dequantize + GEMM",
                                                            "dense fp32 GEMM")], "fastest"]
    notes = (f"ms per layer of the default model's shapes, median of interleaved rounds; ISA {kernels.isa}, "
             f"{args.threads} thread(s). The dense column is not an option for a quantized file (it is the "
             "`--weights dense` cost: 4-byte weights, no dequantizing).")
    path = write_result("qgemm", "Quantized matmul by row count (per-row kernel, wide GEMM, dequantize + GEMM)",
                        markdown_table(header, table), notes)
    print(path)


if __name__ == "__main__":
    main()
