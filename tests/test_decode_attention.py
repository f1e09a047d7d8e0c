"""The decode attention kernel (csrc/decode_attention.h) against its torch twin, `reference.paged_attention`.

Random shapes by hypothesis: block sizes (powers of two and not), GQA ratios 1-8, head dims that take the
kernel's fixed-width and generic score paths on both ISAs, context lengths from 1 up, not multiples of the
block size nor of the key tile (8 or 16 keys), many rows, and large query norms (a softmax far from
uniform, where masked padding lanes would show). Both task shapes run: whole rows (every KV head in one
task) when rows outnumber twice the threads, one KV head per task otherwise. The AVX2 path is forced on
AVX-512 machines by the `kernels` fixture.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kernels import reference

SETTINGS = settings(max_examples=30, deadline=None)


def make_case(seed: int, block_size: int, kv_heads: int, group: int, head_dim: int, lens: list[int],
              query_scale: float):
    """Pools with a few spare blocks, tables a random permutation (padded with valid block ids)."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // block_size) + 1  # one spare column: tables wider than any context
    num_blocks = width * len(lens) + 3
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    values = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    queries = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen) * query_scale
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width).contiguous()
    return queries, keys, values, tables, torch.tensor(lens)


def check(kernels, case, scale: float, atol: float = 1e-5) -> None:
    queries, keys, values, tables, lens = case
    native = kernels.native.paged_attention(queries, keys, values, tables, lens, scale)
    expected = reference.paged_attention(queries, keys, values, tables, lens, scale)
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=atol)


def head_dims(kernels) -> st.SearchStrategy[int]:
    width = 16 if kernels.isa == "avx512" else 8
    return st.sampled_from([d for d in (16, 32, 48, 64, 80, 128) if d % width == 0])


@contextmanager
def library_threads(kernels, count: int):
    """The library's thread count for the calls: 8 threads make rows < 16 split into one KV head per task."""
    kernels.native.lib.kv_set_num_threads(count)
    try:
        yield
    finally:
        kernels.native.lib.kv_set_num_threads(torch.get_num_threads())


@SETTINGS
@given(data=st.data(), block_size=st.sampled_from([1, 2, 3, 4, 8, 16, 32]), kv_heads=st.integers(1, 4),
       group=st.integers(1, 8), lens=st.lists(st.integers(1, 90), min_size=1, max_size=12),
       query_scale=st.sampled_from([1.0, 8.0]), threads=st.sampled_from([1, 8]), seed=st.integers(0, 2**16))
def test_decode_attention_matches_twin(kernels, data, block_size, kv_heads, group, lens, query_scale, threads, seed):
    head_dim = data.draw(head_dims(kernels))
    case = make_case(seed, block_size, kv_heads, group, head_dim, lens, query_scale)
    # A score's float32 rounding error grows with the logits' size, and a sharp softmax hands it on to the
    # output: 8x queries at head dim 128 measured 1.04e-5 on one output (seed 396), over a flat 1e-5. Padding
    # lanes or a wrong mask would be off by orders of magnitude more.
    with library_threads(kernels, threads):
        check(kernels, case, head_dim**-0.5, atol=1e-5 * query_scale)


@pytest.mark.parametrize("threads", [1, 8])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 31, 33, 300])
def test_tile_and_block_boundaries(kernels, threads, length):
    """Lengths around the key tile (8 / 16) and block size 16, and one long context, for 40 rows of
    SmolLM2's shape (9 heads over 3 KV heads, head dim 64)."""
    lens = [length] + [max(1, (length * (i + 3)) % 97) for i in range(39)]
    case = make_case(length, 16, 3, 3, 64, lens, 4.0)
    with library_threads(kernels, threads):
        check(kernels, case, 0.125)


@pytest.mark.parametrize("threads", [1, 8])
def test_rows_sharing_one_table(kernels, threads):
    """Stride 0 (a prefill chunk's rows over one table): each row sees its own prefix of it."""
    queries, keys, values, tables, _ = make_case(7, 4, 2, 3, 32, [50] * 6, 2.0)
    lens = torch.tensor([1, 5, 17, 33, 49, 50])
    with library_threads(kernels, threads):
        native = kernels.native.paged_attention(queries, keys, values, tables[0], lens, 0.2)
    expected = reference.paged_attention(queries, keys, values, tables[0].expand(6, -1), lens, 0.2)
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-5)


def test_one_key_is_its_value(kernels):
    """A context of one token: the output is that token's value, exactly, for every head of the group."""
    queries, keys, values, tables, _ = make_case(3, 16, 3, 3, 64, [1, 1], 1.0)
    out = kernels.native.paged_attention(queries, keys, values, tables, torch.tensor([1, 1]), 0.125)
    for row in range(2):
        first = values[tables[row, 0], 0]  # [KVH, D]
        assert torch.equal(out[row], first.repeat_interleave(3, dim=0))
