"""Prefill attention alone, by how its products run: float32 pool, bf16 pool with float32 products (FMAs, or
AMX-BF16 tiles on three bf16 parts of each query and probability), and `--attention-dtype bfloat16`'s bf16
products as FMAs on the rounded values, AVX512-BF16 pair dot products and AMX-BF16 tiles (where the CPU has
them; kernels/pair_products.py picks FMAs or pairs per CPU, the tiles win where on).

One causal span of N tokens of the default model's shape (9 heads, 3 KV heads, head dim 64, 16-token blocks)
through `NativeLibrary.prefill_attention`, best of `--repeats`, milliseconds per layer and multiply-adds per
second (N^2 / 2 query-key pairs x 9 heads x 64 x 2). Which product route a row takes is the library's choice
for the CPU (csrc/prefill.h's pf_route); each row sets the AMX and pair switches it names, then the CPU's
choice is restored.

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
    from kvserve.kernels import pair_products
    from kvserve.kernels.ops import Kernels

    gen = torch.Generator().manual_seed(0)
    blocks = -(-tokens // BLOCK)
    keys, values = (torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen) for _ in range(2))
    queries = torch.randn(tokens, HEADS, DIM, generator=gen)
    spans, table = torch.tensor([[0, tokens, tokens]]), torch.arange(blocks).view(1, -1)
    out = torch.empty_like(queries)
    macs = tokens * tokens / 2 * HEADS * DIM * 2
    rows = []
    k16, v16 = keys.bfloat16(), values.bfloat16()
    for isa in ("avx512", "avx2"):
        native = Kernels.create("native", isa=isa).native
        if native is None or native.isa != isa:
            continue
        tiles = native.set_amx_exact(True)
        pairs = isa == "avx512" and pair_products.set_pairs(native, True)
        cases = [("float32 pool", keys, values, False, False, False),
                 ("bf16 pool, float32 products", k16, v16, False, False, False),
                 ("bf16 products (FMAs on the rounded values)", k16, v16, True, False, False)]
        if pairs:
            cases.append(("bf16 products (AVX512-BF16 pairs)", k16, v16, True, False, True))
        if tiles:
            cases.append(("bf16 pool, float32 products (AMX tiles, 3 bf16 parts)", k16, v16, False, True, False))
            cases.append(("bf16 products (AMX tiles)", k16, v16, True, True, False))
        for name, k, v, bf16, on, pairs_on in cases:
            native.set_amx_exact(on)
            pair_products.set_pairs(native, pairs_on)
            ms = best_ms(lambda k=k, v=v, bf16=bf16, native=native: native.prefill_attention(
                queries, k, v, spans, table, DIM ** -0.5, out=out, bf16_products=bf16), repeats)
            rows.append([tokens, isa, name, ms, macs / ms / 1e6])
        native.set_amx_exact(True)
        pair_products.apply(native)  # this CPU's choice again
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
