"""Today's native kernels against a git revision's, call by call, in one process: a paired before/after.

Kernel changes on a shared 2-core VM are only visible side by side: its speed swings by 10-30% between
minutes. This loads this checkout's library and `--before REV`'s (built from that revision's csrc/ with
today's flags, as `native_kernels.py --before`), and times, in interleaved rounds (each library once per round),
three kernels on the default model's shapes: the exact wide GEMM (`qgemm`: one layer's four matmuls, random
Q4_1 blocks), the int8 path's packed matmul (`qmatmul_i8_packed`, the same layer), and prefill attention
(`prefill_attention`: one causal span, 9 query heads over 3 KV heads of 64). Per figure: the median of the
rounds for each library, their ratio, and whether the outputs are bit-identical (they need not be: a
change may reorder a sum; `tests/` hold each kernel to its torch twin).

    python benchmarks/kernel_ab.py --before 82cdd2d                 # ~1 minute on 2 cores
    python benchmarks/kernel_ab.py --before 82cdd2d --isa avx2      # the AVX2 path on an AVX-512 CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from kvserve.kernels import build  # noqa: E402
from kvserve.kernels.native import NativeLibrary  # noqa: E402
from native_kernels import build_revision  # noqa: E402
from qgemm import LAYER, random_quant  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYER_FLOPS_PER_ROW = 2 * sum(n * k for n, k in LAYER)


def _qgemm_case(rows: int, rng: np.random.Generator) -> Callable[[NativeLibrary], list[torch.Tensor]]:
    weights = [random_quant(n, k, 3, rng) for n, k in LAYER]
    xs = [torch.randn(rows, k) for _, k in LAYER]
    return lambda lib: [lib.qgemm(x, w.data, w.qtype, w.in_features) for x, w in zip(xs, weights, strict=True)]


def _int8_case(rows: int, rng: np.random.Generator,
               packer: NativeLibrary) -> Callable[[NativeLibrary], list[torch.Tensor]]:
    weights = [random_quant(n, k, 3, rng) for n, k in LAYER]
    packed = [packer.pack_i8(w.data, w.qtype, w.in_features) for w in weights]  # one layout, both libraries
    xs = [torch.randn(rows, k) for _, k in LAYER]
    return lambda lib: [lib.qmatmul_i8_packed(x, p) for x, p in zip(xs, packed, strict=True)]


def _attention_case(tokens: int) -> Callable[[NativeLibrary], list[torch.Tensor]]:
    blocks = -(-tokens // BLOCK)
    keys, values = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM), torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM)
    queries = torch.randn(tokens, HEADS, HEAD_DIM)
    spans, tables = torch.tensor([[0, tokens, tokens]]), torch.arange(blocks).view(1, -1)
    return lambda lib: [lib.prefill_attention(queries, keys, values, spans, tables, HEAD_DIM ** -0.5)]


def paired(libs: dict[str, NativeLibrary], case, rounds: int) -> tuple[dict[str, float], bool]:
    """Median seconds per library over `rounds` interleaved rounds (the order alternates), and whether every
    round's outputs matched bit for bit."""
    times: dict[str, list[float]] = {name: [] for name in libs}
    same = True
    order = list(libs.items())
    for index in range(rounds):
        outputs = {}
        for name, lib in order if index % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            outputs[name] = case(lib)
            times[name].append(time.perf_counter() - start)
        first, second = outputs.values()
        same = same and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    return {name: statistics.median(values) for name, values in times.items()}, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, metavar="REV", help="git revision to compare with")
    parser.add_argument("--isa", choices=("avx2", "avx512"), help="force an ISA (default: the widest)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--gemm-rows", default="16,48,128,512,2048")
    parser.add_argument("--int8-rows", default="8,16,32,128")
    parser.add_argument("--tokens", default="128,512,2048", help="prefill attention span lengths")
    parser.add_argument("--out", default="kernel_ab", metavar="NAME", help="results file benchmarks/results/NAME.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        before = NativeLibrary.load(build_revision(args.before, Path(workdir)), args.isa)
        now = NativeLibrary.load(build.build(), args.isa)
        libs = {"now": now, "before": before}
        rng = np.random.default_rng(0)
        cases = ([("qgemm (exact, one layer)", f"{rows} rows", rows * LAYER_FLOPS_PER_ROW,
                   _qgemm_case(rows, rng)) for rows in map(int, args.gemm_rows.split(","))]
                 + [("qmatmul_i8_packed (int8, one layer)", f"{rows} rows", rows * LAYER_FLOPS_PER_ROW,
                     _int8_case(rows, rng, now)) for rows in map(int, args.int8_rows.split(","))]
                 + [("prefill_attention (one span)", f"{tokens} tokens", tokens * tokens // 2 * HEADS * HEAD_DIM * 4,
                     _attention_case(tokens)) for tokens in map(int, args.tokens.split(","))])
        table = []
        for kernel, size, flops, case in cases:
            case(now)  # warm-up: scratch arenas, pages
            case(before)
            medians, same = paired(libs, case, args.rounds)
            table.append([kernel, size, medians["before"] * 1e3, medians["now"] * 1e3,
                          flops / medians["now"] / 1e9, medians["before"] / medians["now"], "yes" if same else "no"])
            print(table[-1], flush=True)
    header = ["kernel", "size", f"before ({args.before}) ms", "now ms", "now GFLOP/s", "now / before speed",
              "same bits"]
    notes = (f"ISA {now.isa}; median of {args.rounds} interleaved rounds (each library once per round, the order "
             f"alternating); {torch.get_num_threads()} thread(s). int8: both libraries run the packed layout "
             "today's library makes (the layout is the same in every revision that has kv_pack_i8).")
    path = write_result(args.out, f"Native kernels now against {args.before}, paired",
                        markdown_table(header, table), notes)
    print(path)


if __name__ == "__main__":
    main()
