"""Prefill attention alone, by how its products run: float32 pool, bf16 pool with float32 products (FMAs, or
AMX-BF16 tiles on three bf16 parts of each query and probability), and `--attention-dtype bfloat16`'s bf16
products as FMAs (AVX2 build), AVX512-BF16 pair dot products and AMX-BF16 tiles (where the CPU has them).

One causal span of N tokens of the default model's shape (9 heads, 3 KV heads, head dim 64, 16-token blocks)
through `NativeLibrary.prefill_attention`, best of `--repeats`, milliseconds per layer and multiply-adds per
second (N^2 / 2 query-key pairs x 9 heads x 64 x 2). Which product route a row takes is the library's choice
for the CPU (csrc/prefill.h's pf_route); the tile rows turn the AMX switch on, the pair rows off.

    python benchmarks/attention_products.py [--tokens 512 2048] [--threads 2]

Prints a markdown table; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, markdown_table  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def rows_for(tokens: int, repeats: int) -> list[list[object]]:
    from kvserve.kernels.ops import Kernels

    gen = torch.Generator().manual_seed(0)
    blocks = -(-tokens // BLOCK)
    keys, values = (torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen) for _ in range(2))
    queries = torch.randn(tokens, HEADS, DIM, generator=gen)
    spans, table = torch.tensor([[0, tokens, tokens]]), torch.arange(blocks).view(1, -1)
    out = torch.empty_like(queries)
    macs = tokens * tokens / 2 * HEADS * DIM * 2
    rows = []
    for isa in ("avx512", "avx2"):
        native = Kernels.create("native", isa=isa).native
        if native is None or native.isa != isa:
            continue
        tiles = native.set_amx_exact(True)
        cases = [("float32 pool", keys, values, False, False), ("bf16 pool, float32 products", keys.bfloat16(),
                 values.bfloat16(), False, False)]
        products = "AVX512-BF16 pairs" if isa == "avx512" and "avx512_bf16" in native.features else "FMAs"
        cases.append((f"bf16 products ({products})", keys.bfloat16(), values.bfloat16(), True, False))
        if tiles:
            cases.append(("bf16 pool, float32 products (AMX tiles, 3 bf16 parts)", keys.bfloat16(), values.bfloat16(),
                          False, True))
            cases.append(("bf16 products (AMX tiles)", keys.bfloat16(), values.bfloat16(), True, True))
        for name, k, v, bf16, on in cases:
            native.set_amx_exact(on)
            ms = best_ms(lambda k=k, v=v, bf16=bf16, native=native: native.prefill_attention(
                queries, k, v, spans, table, DIM ** -0.5, out=out, bf16_products=bf16), repeats)
            rows.append([tokens, isa, name, ms, macs / ms / 1e6])
        native.set_amx_exact(True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [row for tokens in args.tokens for row in rows_for(tokens, args.repeats)]
    print(markdown_table(["tokens", "build", "products", "ms / layer", "GMAC/s"], rows))
    print(f"\n{machine()}; best of {args.repeats}; threads {args.threads}.")


if __name__ == "__main__":
    main()
