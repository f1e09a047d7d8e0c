"""Paged attention over the KV pool.

New keys/values are written into their pool slots, then every sequence attends over its block table.
With native kernels (a float32 or bf16 pool), everything reads K/V in place through the block tables (no per-step
copy of the context): decodes one row each (or cascade groups, below), and every prefill chunk of the
step -- fresh, or continuing after cached or earlier-chunked blocks -- in one call that tiles each
chunk's queries against its keys (csrc/prefill.h: ~1.3x torch's flash attention per core, measured in
benchmarks/native_kernels.py, and no gather). Otherwise (the torch path): decodes are batched into one padded
call over gathered blocks, and prefill spans run one call each (they are few per step, and padding a
2,048-token chunk to the width of 31 single-token decodes would cost far more than the loop); a fresh
prefill uses torch's causal flash attention on the new keys directly. Either way, decodes that share
leading blocks (a cached prefix, forked samples) attend to them once per group (cascade attention,
`kv/cascade.py`, native or its torch twin).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kernels.cascade_plan import CascadeTensors
from kvserve.kernels.ops import Kernels
from kvserve.kernels.reference import causal_attention, store_slots


@dataclass(slots=True)
class PrefillSpan:
    """Rows [start, end) of the flat batch: one sequence's new tokens, ending at `context_len`."""

    start: int
    end: int
    context_len: int  # tokens in the cache once this step's keys are written
    block_table: torch.Tensor  # [ceil(context_len / block_size)] block ids


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the pool and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] pool slot of each new token
    num_decodes: int  # rows [0, num_decodes) are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor | None  # [num_decodes]
    decode_key_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size], True = attend
    prefills: list[PrefillSpan]
    decode_cascade: CascadeTensors | None = None  # decode rows sharing leading blocks (kv/cascade.py)
    native_spans: tuple[torch.Tensor, torch.Tensor] | None = None  # prefills for the native kernel, built once


def write_kv(
    key_blocks: torch.Tensor, value_blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's keys/values ``[num_tokens, kv_heads, head_dim]`` at their slots."""
    store_slots(key_blocks, slot_mapping, keys)
    store_slots(value_blocks, slot_mapping, values)


def paged_attention(
    queries: torch.Tensor, keys: torch.Tensor | None, values: torch.Tensor | None,
    key_blocks: torch.Tensor, value_blocks: torch.Tensor, meta: AttentionMetadata, scale: float,
    kernels: Kernels | None = None, kv_written: bool = False,
) -> torch.Tensor:
    """Attention for a flat batch. queries ``[T, heads, D]``, keys/values ``[T, kv_heads, D]``.

    Writes keys/values into the pool first, so decodes and continued prefills read them back from
    their blocks; `kv_written`: a fused kernel already did (`Kernels.rope_kv_write`), and keys/values
    may be None (a fresh prefill then reads its keys back from the slots). Returns ``[T, heads * D]``.
    """
    in_place = kernels is not None and kernels.supports_paged_attention(queries, key_blocks)
    bf16_products = kernels is not None and kernels.bf16_products
    if not kv_written:
        write_kv(key_blocks, value_blocks, keys, values, meta.slot_mapping)
    if meta.prefills and not in_place and (keys is None or key_blocks.dtype != keys.dtype):
        # Attention sees K/V as the pool holds them (a bf16 KV cache: rounded), fresh or cached alike, so a
        # prefix-cache hit never changes an output.
        keys, values = (blocks.view(-1, *blocks.shape[2:])[meta.slot_mapping].to(queries.dtype)
                        for blocks in (key_blocks, value_blocks))
    num_tokens, num_heads, head_dim = queries.shape
    output = torch.empty(num_tokens, num_heads, head_dim, dtype=queries.dtype, device=queries.device)
    if meta.num_decodes and meta.decode_cascade is not None and kernels is not None:
        output[: meta.num_decodes] = kernels.cascade_attention(
            queries[: meta.num_decodes], key_blocks, value_blocks, meta.decode_block_tables,
            meta.decode_context_lens, meta.decode_cascade, scale,
        )
    elif meta.num_decodes and in_place:
        output[: meta.num_decodes] = kernels.paged_attention(
            queries[: meta.num_decodes], key_blocks, value_blocks, meta.decode_block_tables,
            meta.decode_context_lens, scale,
        )
    elif meta.num_decodes:
        output[: meta.num_decodes] = _decode_attention(
            queries[: meta.num_decodes], key_blocks, value_blocks, meta, scale
        )
    if meta.prefills and in_place:
        # Every prefill chunk (fresh or after cached blocks) in one native call: query tiles against the
        # pool's keys in place (csrc/prefill.h), no gather, both threads busy across spans and KV heads.
        if meta.native_spans is None:
            meta.native_spans = native_spans(meta.prefills, queries.device)
        spans, tables = meta.native_spans
        kernels.native.prefill_attention(queries.contiguous(), key_blocks, value_blocks, spans, tables, scale,
                                         out=output, bf16_products=bf16_products)
        return output.view(num_tokens, num_heads * head_dim)
    for span in meta.prefills:
        output[span.start : span.end] = _prefill_attention(
            queries[span.start : span.end], keys[span.start : span.end], values[span.start : span.end],
            key_blocks, value_blocks, span, scale, bf16_products,
        )
    return output.view(num_tokens, num_heads * head_dim)


def native_spans(prefills: list[PrefillSpan], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The spans as the native prefill kernel takes them: ``[S, 3]`` (first row, tokens, context length)
    and their block tables padded to one width (padding is never read: it lies past every context)."""
    spans = torch.tensor([[span.start, span.end - span.start, span.context_len] for span in prefills],
                         dtype=torch.long, device=device)
    if len(prefills) == 1:
        return spans, prefills[0].block_table.view(1, -1).contiguous()
    width = max(len(span.block_table) for span in prefills)
    tables = torch.zeros(len(prefills), width, dtype=torch.long, device=device)
    for index, span in enumerate(prefills):
        tables[index, : len(span.block_table)] = span.block_table
    return spans, tables


def _decode_attention(
    queries: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = queries.shape
    num_kv_heads = key_blocks.shape[2]
    # Gather each sequence's blocks into a padded [B, kv_heads, L, D] context; padding is masked.
    context_keys = _gather_blocks(key_blocks, meta.decode_block_tables, queries.dtype).view(
        num_seqs, -1, num_kv_heads, head_dim
    )
    context_values = _gather_blocks(value_blocks, meta.decode_block_tables, queries.dtype).view(
        num_seqs, -1, num_kv_heads, head_dim
    )
    if queries.dtype != torch.float32:
        return _grouped_decode_attention(queries, context_keys, context_values, meta.decode_key_mask, scale)
    out = F.scaled_dot_product_attention(
        queries.unsqueeze(2),
        context_keys.transpose(1, 2),
        context_values.transpose(1, 2),
        attn_mask=meta.decode_key_mask,
        scale=scale,
        enable_gqa=num_kv_heads != num_heads,
    )
    return out.squeeze(2)


def _grouped_decode_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode attention as two batched matmuls per KV-head group, softmax in float32.

    For bf16/fp16 the CPU flash kernel is 3-5x slower than this at one query token (measured: 3.9 ms vs
    0.7 ms for 32 sequences of 224 tokens); for fp32 the flash kernel wins, so it stays there.
    """
    num_seqs, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[2]
    grouped = queries.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(grouped, keys.permute(0, 2, 3, 1)) * scale  # [B, kv_heads, group, L]
    scores = scores.masked_fill(~key_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    return torch.matmul(probs, values.transpose(1, 2)).reshape(num_seqs, num_heads, head_dim)


def _prefill_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    key_blocks: torch.Tensor, value_blocks: torch.Tensor, span: PrefillSpan, scale: float,
    bf16_products: bool = False,
) -> torch.Tensor:
    """One chunk's causal attention (torch's SDPA); `bf16_products`: the native kernel's ATTN_BF16 rounding
    (`reference.causal_attention`: queries and probabilities rounded to bf16, float32 sums)."""
    num_new, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    num_cached = span.context_len - num_new
    if num_cached == 0:
        # Nothing before this chunk: attend to the fresh keys directly, plain causal mask.
        context_keys, context_values, mask, causal = keys, values, None, True
    else:
        context_keys = _gather_blocks(key_blocks, span.block_table, queries.dtype).view(-1, num_kv_heads, head_dim)
        context_values = _gather_blocks(value_blocks, span.block_table, queries.dtype).view(-1, num_kv_heads, head_dim)
        context_keys, context_values = context_keys[: span.context_len], context_values[: span.context_len]
        query_pos = torch.arange(num_cached, span.context_len, device=queries.device)
        key_pos = torch.arange(span.context_len, device=queries.device)
        mask, causal = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1), False
    if bf16_products:
        return causal_attention(queries, context_keys, context_values, num_cached, scale, True).to(queries.dtype)
    out = F.scaled_dot_product_attention(
        queries.transpose(0, 1).unsqueeze(0),
        context_keys.transpose(0, 1).unsqueeze(0),
        context_values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=num_kv_heads != num_heads,
    )
    return out.squeeze(0).transpose(0, 1)


def _gather_blocks(blocks: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Copy the listed blocks out of the pool (index_select: ~10x faster than advanced indexing on CPU), in the
    queries' dtype (a bf16 KV cache under float32 activations is widened exactly)."""
    return blocks.index_select(0, block_table.reshape(-1)).to(dtype)
