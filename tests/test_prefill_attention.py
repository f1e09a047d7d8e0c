"""The native prefill attention kernel (csrc/prefill.h) against its torch twin, on both ISAs.

Its twin is `reference.paged_attention` with one row per token, each over its span's block table up to
its own position (that is what causal prefill through the pool means). Random shapes: block sizes,
GQA ratios, head sizes, spans fresh or continuing after cached tokens, lengths around the kernel's
32-token query tiles and 64-key steps, several spans in one call; and `kv/attention.paged_attention`
with native kernels against the torch path on a mixed step (decodes plus chunks).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kernels import reference
from kvserve.kv.attention import AttentionMetadata, PrefillSpan, paged_attention

SETTINGS = settings(max_examples=25, deadline=None)


def _pool(gen: torch.Generator, num_blocks: int, block_size: int, kv_heads: int, head_dim: int):
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    values = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    return keys, values


def _expected(queries, keys, values, spans, tables, scale):
    """One reference row per token: span row i sees its table's first context - tokens + i + 1 keys."""
    out = torch.zeros_like(queries)
    for (start, tokens, context), table in zip(spans.tolist(), tables, strict=True):
        lens = torch.arange(context - tokens + 1, context + 1)
        rows = queries[start : start + tokens]
        out[start : start + tokens] = reference.paged_attention(
            rows, keys, values, table.expand(tokens, -1), lens, scale)
    return out


@SETTINGS
@given(
    block_size=st.sampled_from([1, 4, 16, 32]), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4]),
    head_dim=st.sampled_from([16, 64]),
    chunks=st.lists(st.tuples(st.integers(0, 140), st.integers(1, 80)), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_prefill_attention_matches_reference(kernels, block_size, kv_heads, group, head_dim, chunks, seed):
    """Spans of `tokens` new rows after `cached` tokens, each with its own table, in one call."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-(cached + tokens) // block_size) for cached, tokens in chunks]
    num_blocks = sum(widths) + 2
    keys, values = _pool(gen, num_blocks, block_size, kv_heads, head_dim)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(chunks), max(widths), dtype=torch.long)
    spans, start, used = [], 0, 0
    for index, ((cached, tokens), width) in enumerate(zip(chunks, widths, strict=True)):
        tables[index, :width] = order[used : used + width]
        used += width
        spans.append([start, tokens, cached + tokens])
        start += tokens
    spans = torch.tensor(spans)
    queries = torch.randn(start, kv_heads * group, head_dim, generator=gen)
    native = kernels.native.prefill_attention(queries, keys, values, spans, tables, 0.3)
    torch.testing.assert_close(native, _expected(queries, keys, values, spans, tables, 0.3), rtol=1e-5, atol=1e-5)


def test_prefill_attention_leaves_other_rows_and_checks_arguments(kernels):
    gen = torch.Generator().manual_seed(0)
    keys, values = _pool(gen, 8, 16, 1, 16)
    queries = torch.randn(10, 2, 16, generator=gen)
    out = torch.full_like(queries, 7.0)
    spans, table = torch.tensor([[2, 5, 40]]), torch.arange(3).view(1, 3)
    kernels.native.prefill_attention(queries, keys, values, spans, table, 0.25, out=out)
    assert torch.equal(out[:2], torch.full_like(out[:2], 7.0)) and torch.equal(out[7:], torch.full_like(out[7:], 7.0))
    torch.testing.assert_close(out[2:7], _expected(queries, keys, values, spans, table, 0.25)[2:7])
    for bad in ([[0, 5, 49]], [[8, 5, 40]], [[0, 0, 4]], [[0, 5, 4]]):  # past the table, the rows; empty; short
        with pytest.raises(ValueError, match="span"):
            kernels.native.prefill_attention(queries, keys, values, torch.tensor(bad), table, 0.25)


@SETTINGS
@given(decodes=st.integers(0, 3), chunks=st.lists(st.tuples(st.integers(0, 70), st.integers(2, 70)), min_size=1,
                                                   max_size=3), seed=st.integers(0, 2**16))
def test_mixed_step_native_equals_torch_path(kernels, decodes, chunks, seed):
    """kv/attention.paged_attention: decodes plus fresh and continued chunks, native against torch."""
    gen = torch.Generator().manual_seed(seed)
    block_size, kv_heads, heads, head_dim = 16, 3, 9, 64
    sequences = [(int(torch.randint(1, 60, (1,), generator=gen)), 1) for _ in range(decodes)] + list(chunks)
    widths = [-(-(cached + tokens) // block_size) for cached, tokens in sequences]
    num_blocks = sum(widths) + 1
    keys_pool, values_pool = _pool(gen, num_blocks, block_size, kv_heads, head_dim)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for width in widths:
        tables.append(order[used : used + width])
        used += width
    total = sum(tokens for _, tokens in sequences)
    queries = torch.randn(total, heads, head_dim, generator=gen)
    new_keys = torch.randn(total, kv_heads, head_dim, generator=gen)
    new_values = torch.randn(total, kv_heads, head_dim, generator=gen)
    slots, spans, row = [], [], decodes
    for (cached, tokens), table in zip(sequences, tables, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, cached + tokens)]
    for (cached, tokens), table in zip(sequences[decodes:], tables[decodes:], strict=True):
        spans.append(PrefillSpan(row, row + tokens, cached + tokens, torch.tensor(table)))
        row += tokens
    max_blocks = max(widths[:decodes], default=1)
    lens = torch.tensor([cached + 1 for cached, _ in sequences[:decodes]], dtype=torch.long)
    decode_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables[:decodes]], dtype=torch.long)
    key_mask = (torch.arange(max_blocks * block_size).unsqueeze(0) < lens.unsqueeze(1)).unsqueeze(1).unsqueeze(1)

    def run(kernels_or_none):
        meta = AttentionMetadata(torch.tensor(slots), decodes, decode_tables if decodes else None,
                                 lens if decodes else None, key_mask if decodes else None, spans)
        pools = (keys_pool.clone(), values_pool.clone())
        return paged_attention(queries, new_keys, new_values, *pools, meta, 0.125, kernels_or_none)

    torch.testing.assert_close(run(kernels), run(None), rtol=1e-5, atol=1e-5)
