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
    python benchmarks/attention_products.py --tokens 100 --cached 1900   # the seed's turn: 100 after 1,900

`--before REV` instead times this CPU's default route over each pool (float32, bf16 with float32 products,
bf16 products, fp8) with the library built from git revision REV's csrc/ and with today's, interleaved, and
says whether the two give the same bits:

    python benchmarks/attention_products.py --before b58efbe~1 --repeats 7

Prints a markdown table; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
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


def span_inputs(tokens: int, cached: int = 0) -> tuple[torch.Tensor, ...]:
    """One causal span of `tokens` after `cached` tokens (a chat turn over its history), over a float32 pool
    laid out in order: keys, values, queries, spans, table."""
    gen = torch.Generator().manual_seed(0)
    blocks = -(-(cached + tokens) // BLOCK)
    keys, values = (torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen) for _ in range(2))
    queries = torch.randn(tokens, HEADS, DIM, generator=gen)
    return keys, values, queries, torch.tensor([[0, tokens, cached + tokens]]), torch.arange(blocks).view(1, -1)


def span_macs(tokens: int, cached: int) -> float:
    """Multiply-adds of both products: each query meets the cached keys and, causally, half its span's."""
    return tokens * (cached + tokens / 2) * HEADS * DIM * 2


def rows_for(tokens: int, repeats: int, cached: int = 0) -> list[list[object]]:
    from kvserve.kernels import pair_products
    from kvserve.kernels.ops import Kernels

    keys, values, queries, spans, table = span_inputs(tokens, cached)
    out = torch.empty_like(queries)
    macs = span_macs(tokens, cached)
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


def before_after_rows(tokens: int, repeats: int, libraries: dict, cached: int = 0) -> list[list[object]]:
    """Per pool: ms per layer with each library (REV's and today's; the CPU's route in both), interleaved."""
    keys, values, queries, spans, table = span_inputs(tokens, cached)
    macs = span_macs(tokens, cached)
    cases = [("float32 pool", keys, values, False), ("bf16 pool, float32 products", keys.bfloat16(),
              values.bfloat16(), False), ("bf16 products", keys.bfloat16(), values.bfloat16(), True),
             ("fp8 pool, float32 products", keys.to(torch.float8_e4m3fn), values.to(torch.float8_e4m3fn), False)]
    rows = []
    for name, k, v, bf16 in cases:
        best, outputs = dict.fromkeys(libraries, float("inf")), {}
        for _ in range(repeats):
            for label, native in libraries.items():
                start = time.perf_counter()
                outputs[label] = native.prefill_attention(queries, k, v, spans, table, DIM ** -0.5, bf16_products=bf16)
                best[label] = min(best[label], time.perf_counter() - start)
        same = "yes" if torch.equal(*outputs.values()) else "no"
        rows += [[tokens, name, label, 1e3 * ms, macs / ms / 1e9, same] for label, ms in best.items()]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", metavar="REV", help="time REV's library against today's instead")
    parser.add_argument("--cached", type=int, default=0, help="tokens before the span (a turn over a history)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.before:
        from kvserve.kernels import build
        from kvserve.kernels.native import NativeLibrary
        from native_kernels import build_revision

        with tempfile.TemporaryDirectory() as workdir:
            libraries = {f"before ({args.before})": NativeLibrary.load(build_revision(args.before, Path(workdir))),
                         "now": NativeLibrary.load(build.build())}
            rows = [row for tokens in args.tokens
                    for row in before_after_rows(tokens, args.repeats, libraries, args.cached)]
        print(markdown_table(["tokens", "pool / products", "library", "ms / layer", "GMAC/s", "same bits"], rows))
        print(f"\n{machine()}; best of {args.repeats}, interleaved; threads {args.threads}.")
        return
    rows = [row for tokens in args.tokens for row in rows_for(tokens, args.repeats, args.cached)]
    print(markdown_table(["tokens", "build", "products", "ms / layer", "GMAC/s"], rows))
    print(f"\n{machine()}; best of {args.repeats}; threads {args.threads}; {args.cached} tokens cached before each.")


if __name__ == "__main__":
    main()
