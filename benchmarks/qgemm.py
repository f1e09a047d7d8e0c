"""Quantized matmuls by row count: where the wide GEMM (csrc/qgemm.h; csrc/qgemm_wide.h on AVX2 from 48 rows)
beats the per-row kernel, and how both compare with dequantize + torch's GEMM and with dense float32 weights (torch's
GEMM, no dequantizing).

One layer of the default model (fused q/k/v 960x576, o 576x576, gate/up 3072x576, down 576x1536) in
random Q4_1 / Q8_0 blocks, x of M rows; ms per layer is the median of `--rounds` interleaved rounds (each
method measured once per round, so a burst of load on the shared machine hits all of them alike).
The crossovers `kernels/ops.py` dispatches on come from this table.

    python benchmarks/qgemm.py                 # about 2 minutes on 2 cores
    python benchmarks/qgemm.py --threads 1     # the kernels alone, without the second core's noise
    python benchmarks/qgemm.py --end-to-end    # the default model: native Q4_1 vs dense fp32 weights

`--end-to-end` runs the engine instead (benchmarks/native_kernels.py's runner): generated tokens / wall second
for batches of 8, 32 and 64 greedy requests (the `batch` workloads; 64 = the 32 prompts twice) and prefill
tok/s at 512 and 2,048 tokens, for `--weights native` (the GGUF's Q4_1/Q8_0 as stored, fp32 activations)
and `--weights dense` (float32), interleaved; each figure the best of `--repeats`.
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


def _tiles_only(native, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The AVX2 wide GEMM with qgemm.h's tiles at every row count (its crossover to qgemm_wide.h out of reach):
    the kernel `wide qgemm` ran before qgemm_wide.h, beside it in the same rounds."""
    default = native.wide_gemm_rows(1 << 40)
    try:
        return native.qgemm(x, w.data, w.qtype, w.in_features)
    finally:
        native.wide_gemm_rows(default)


def measure(kernels: Kernels, qtype: int, rows: int, rounds: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    weights = [random_quant(n, k, qtype, rng) for n, k in LAYER]
    dense = [reference.dequantize(w).t().contiguous() for w in weights]
    xs = [torch.randn(rows, k) for _, k in LAYER]
    native = kernels.native
    methods = {
        "per-row qmatmul": lambda x, w, d: native.qmatmul(x, w.data, w.qtype, w.in_features),
        "wide qgemm": lambda x, w, d: native.qgemm(x, w.data, w.qtype, w.in_features),
        **({"qgemm.h tiles": lambda x, w, d: _tiles_only(native, x, w)} if native.isa == "avx2" else {}),
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


def end_to_end(new: int, repeats: int) -> None:
    from common import load_workloads
    from native_kernels import KvserveRunner

    workloads = load_workloads()
    prompts = workloads["batch"]["32"]["prompts"]
    runners = [KvserveRunner(f"--weights {w}", {"kernels": "native", "weights": w}) for w in ("native", "dense")]
    tasks = {
        "batch 8 tok/s": lambda r: r.batch(workloads["batch"]["8"]["prompts"], new),
        "batch 32 tok/s": lambda r: r.batch(prompts, new),
        "batch 64 tok/s": lambda r: r.batch(prompts + prompts, new),
        "prefill 512 tok/s": lambda r: r.prefill(workloads["prefill"]["512"]),
        "prefill 2048 tok/s": lambda r: r.prefill(workloads["prefill"]["2048"]),
    }
    for runner in runners:
        runner.decode(workloads["prefill"]["128"], 8)  # warm-up
    best: dict[str, dict[str, float]] = {runner.name: {} for runner in runners}
    for key, task in tasks.items():
        for _ in range(repeats):
            for runner in runners:
                value = task(runner)
                best[runner.name][key] = max(best[runner.name].get(key, 0.0), value)
                print(f"{key:20s} {runner.name:18s} {value:9.2f}", flush=True)
    native, dense = (best[r.name] for r in runners)
    rows = [[name, *best[name].values()] for name in best]
    rows.append(["native / dense", *(native[k] / dense[k] for k in tasks)])
    notes = (f"{new} new tokens per request; best of {repeats} interleaved runs; native kernels "
             f"({runners[0].llm.engine.model.kernels.describe()}).")
    path = write_result("qgemm_end_to_end", "Native quantized weights vs dense fp32, default model",
                        markdown_table(["weights", *tasks], rows), notes)
    print(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--end-to-end", action="store_true", help="the engine, native vs dense weights")
    parser.add_argument("--new", type=int, default=32, help="--end-to-end: new tokens per request")
    parser.add_argument("--repeats", type=int, default=2, help="--end-to-end: runs per figure")
    parser.add_argument("--out", default="qgemm", metavar="NAME", help="results file benchmarks/results/NAME.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.end_to_end:
        end_to_end(args.new, args.repeats)
        return
    kernels = Kernels.create("native")
    if kernels.native is None:
        raise SystemExit("the native kernels are unavailable on this machine")
    table, names = [], []
    for qtype in (3, 8):
        for rows in (int(r) for r in args.rows.split(",")):
            ms = measure(kernels, qtype, rows, max(3, args.rounds if rows <= 512 else args.rounds // 2))
            names = list(ms)
            best = min(ms, key=ms.get)
            table.append([QTYPES[qtype][0], rows, *ms.values(), best])
            print(table[-1], flush=True)
    header = ["weights", "rows", *[f"{name} ms" for name in names], "fastest"]
    tiles = (" On AVX2 `wide qgemm` runs csrc/qgemm_wide.h from "
             f"{kernels.native.wide_gemm_rows()} rows; `qgemm.h tiles` is the same call with qgemm.h's tiles at every "
             "row count.") if kernels.isa == "avx2" else ""
    notes = (f"ms per layer of the default model's shapes, median of interleaved rounds; ISA {kernels.isa}, "
             f"{args.threads} thread(s). The dense column is not an option for a quantized file (it is the "
             "`--weights dense` cost: 4-byte weights, no dequantizing)." + tiles)
    path = write_result(args.out, "Quantized matmul by row count (per-row kernel, wide GEMM, dequantize + GEMM)",
                        markdown_table(header, table), notes)
    print(path)


if __name__ == "__main__":
    main()
