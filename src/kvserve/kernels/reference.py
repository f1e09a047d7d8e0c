"""Pure-torch twins of every native kernel: the oracle the native ones are tested against, and the
`--kernels torch` backend. Written for clarity, not speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels.cascade_plan import CascadeTensors
from kvserve.kernels.quant import BLOCK, QuantWeight


def dequantize(weight: QuantWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 ``[rows, in_features]``, rounding exactly as gguf's numpy dequantizer (d*q, then + m)."""
    data = weight.data if rows is None else weight.data.index_select(0, rows.reshape(-1))
    if weight.type_name == "BF16":  # raw bf16 values: exact in float32
        return data.contiguous().view(torch.bfloat16).float().reshape(data.shape[0], weight.in_features)
    blocks = data.view(data.shape[0], weight.in_features // BLOCK, -1)
    scale = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if weight.type_name == "Q8_0":
        quants = blocks[..., 2:].contiguous().view(torch.int8).float()
        values = scale * quants
    else:
        nibbles = blocks[..., 4:] if weight.type_name == "Q4_1" else blocks[..., 2:]
        quants = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
        if weight.type_name == "Q4_1":
            values = scale * quants + blocks[..., 2:4].contiguous().view(torch.float16).float()
        else:
            values = scale * (quants - 8.0)
    return values.reshape(data.shape[0], weight.in_features)


def qlinear(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """``x @ W.T`` for a quantized W, in float32."""
    return F.linear(x.float(), dequantize(weight))


def linear_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``bf16(x) @ bf16(W).T`` in float32 for ``weight [out, in]``: both operands rounded to bf16 (nearest even),
    their products exact in float32 and summed there -- csrc/gemm_bf16.h's arithmetic up to summation order
    (kernels/bf16pack.py, `--prefill-dtype bfloat16`)."""
    return F.linear(x.to(torch.bfloat16).float(), weight.to(torch.bfloat16).float())


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of x as int8 blocks of 32, rounded as the native kernel does: d = max|x| / 127, q = x * (1/d)
    rounded to nearest (ties to even) and clamped to +-127, s = d * sum(q). Returns (q int8 [rows, k],
    d [rows, k/32], s [rows, k/32])."""
    rows, width = x.shape
    blocks = x.float().reshape(rows, width // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    s = d * q.sum(dim=-1, dtype=torch.int32).float()
    return q.reshape(rows, width), d, s


def _weight_blocks(weight: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(integer quants as float [out, nb, 32], scale dw [out, nb], per-block offset multiplier of s or None):
    Q4_1's m, Q4_0's -8*dw (its quants are kept unsigned, 0..15), None for Q8_0."""
    blocks = weight.data.view(weight.out_features, weight.in_features // BLOCK, -1)
    scale = blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    if weight.type_name == "Q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8).float(), scale, None
    nibbles = blocks[..., 4:] if weight.type_name == "Q4_1" else blocks[..., 2:]
    quants = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
    if weight.type_name == "Q4_1":
        return quants, scale, blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    return quants, scale, -8.0 * scale


def qlinear_i8(x: torch.Tensor, weight: QuantWeight, row_chunk: int = 64) -> torch.Tensor:
    """``x @ W.T`` in float32 with x quantized by `quantize_activations`: per block, the exact integer dot
    sum(qw * qx) (float32 holds it exactly: |sum| < 2^24) times dw * dx, plus offset * s."""
    q, d, s = quantize_activations(x)
    quants, scale, offset = _weight_blocks(weight)
    num_blocks = quants.shape[1]
    wq = quants.permute(1, 2, 0)  # [nb, 32, out]
    outs = []
    for start in range(0, q.shape[0], row_chunk):
        qx = q[start : start + row_chunk].float().view(-1, num_blocks, BLOCK).transpose(0, 1)  # [nb, rows, 32]
        isum = torch.bmm(qx, wq)  # [nb, rows, out], exact integers
        dx = d[start : start + row_chunk].t().unsqueeze(-1)  # [nb, rows, 1]
        terms = (scale.t().unsqueeze(1) * dx) * isum
        if offset is not None:
            terms = terms + offset.t().unsqueeze(1) * s[start : start + row_chunk].t().unsqueeze(-1)
        outs.append(terms.sum(dim=0))
    return torch.cat(outs) if outs else x.new_zeros(0, weight.out_features, dtype=torch.float32)


def paged_attention(
    queries: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, bf16_products: bool = False,
) -> torch.Tensor:
    """Row t of ``queries [T, heads, D]`` attends to the first ``context_lens[t]`` tokens of the blocks in
    ``block_tables[t]`` (pool layout ``[num_blocks, block_size, kv_heads, D]``). Float32 ``[T, heads, D]``.
    `bf16_products`: csrc/prefill.h's ATTN_BF16 -- the scaled queries and the unnormalised probabilities
    rounded to bf16 before their products (the kernel rounds against its running max, this against the
    row's max: the same up to bf16 rounding of a few probabilities).
    """
    num_rows, num_heads, head_dim = queries.shape
    num_kv_heads = key_blocks.shape[2]
    keys = key_blocks.index_select(0, block_tables.reshape(-1)).view(num_rows, -1, num_kv_heads, head_dim)
    values = value_blocks.index_select(0, block_tables.reshape(-1)).view(num_rows, -1, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    keys = keys.float().repeat_interleave(group, dim=2)  # [T, L, heads, D]
    values = values.float().repeat_interleave(group, dim=2)
    if bf16_products:  # the kernels scale the queries first, then round
        scores = torch.einsum("thd,tlhd->thl", _bf16(queries.float() * scale), keys)
    else:
        scores = torch.einsum("thd,tlhd->thl", queries.float(), keys) * scale
    positions = torch.arange(keys.shape[1], device=queries.device)
    mask = positions.unsqueeze(0) < context_lens.unsqueeze(1)  # [T, L]
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    if not bf16_products:
        return torch.einsum("thl,tlhd->thd", torch.softmax(scores, dim=-1), values)
    probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return torch.einsum("thl,tlhd->thd", _bf16(probs), values) / probs.sum(dim=-1, keepdim=True)


def causal_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int, scale: float,
    bf16_products: bool = False,
) -> torch.Tensor:
    """Row i of ``queries [T, heads, D]`` sits at position ``first + i`` and attends to ``keys`` / ``values``
    ``[L, kv_heads, D]`` up to it: one prefill chunk over its sequence's keys, as `paged_attention` rows would
    (without gathering a context per row). Float32 ``[T, heads, D]``."""
    group = queries.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)  # [L, heads, D]
    values = values.float().repeat_interleave(group, dim=1)
    q = _bf16(queries.float() * scale) if bf16_products else queries.float() * scale
    scores = torch.einsum("thd,lhd->thl", q, keys)
    visible = torch.arange(keys.shape[0]).unsqueeze(0) <= first + torch.arange(queries.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weights = _bf16(probs) if bf16_products else probs
    return torch.einsum("thl,lhd->thd", weights, values) / probs.sum(dim=-1, keepdim=True)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to bf16 (nearest even) and widened back: the operand a bf16 product sees."""
    return x.to(torch.bfloat16).float()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual): the norm in float32 as HF, the sum for the next add."""
    if residual is not None:
        x = x + residual
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype), x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by per-token ``cos/sin [T, D]`` (HF's rotate-half; float32, cast back)."""
    half = x.shape[-1] // 2
    x_float = x.float()
    rotated = torch.cat([-x_float[..., half:], x_float[..., :half]], dim=-1)
    return (x_float * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


def rope_kv_write(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:
    """Split ``qkv [T, (heads + 2 * kv_heads) * D]``, rotate q and k at `positions` (tables ``[max_pos, D]``),
    store k and v at pool `slots` (``[num_blocks, block_size, kv_heads, D]`` pools); returns q ``[T, heads, D]``.
    """
    head_dim = cos.shape[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    queries, keys, values = qkv.split([q_size, kv_size, kv_size], dim=-1)
    angle_cos, angle_sin = cos[positions], sin[positions]
    queries = apply_rope(queries.reshape(-1, num_heads, head_dim), angle_cos, angle_sin)
    keys = apply_rope(keys.reshape(-1, num_kv_heads, head_dim), angle_cos, angle_sin)
    store_slots(key_blocks, slots, keys)
    store_slots(value_blocks, slots, values.reshape(-1, num_kv_heads, head_dim))
    return queries


def store_slots(blocks: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``rows [T, kv_heads, D]`` into pool slots `slots` of ``blocks [num_blocks, block_size, kv_heads, D]``,
    converted to the pool's dtype (bf16 and fp8 e4m3fn: nearest even, fp8 saturating at +-448 -- torch's casts,
    which csrc/simd.h's stores reproduce bit for bit). fp8 goes through byte views: torch has no index_copy_ for
    float8 on CPU."""
    flat = blocks.view(-1, rows.shape[-2], rows.shape[-1])
    converted = rows.to(blocks.dtype)
    if blocks.dtype == torch.float8_e4m3fn:
        flat, converted = flat.view(torch.uint8), converted.view(torch.uint8)
    flat.index_copy_(0, slots, converted)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2 * I]`` (gate first, as the fused projection stores it)."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def cascade_attention(
    queries: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, plan: CascadeTensors, scale: float, bf16_products: bool = False,
) -> torch.Tensor:
    """`paged_attention`'s result computed in two parts merged by log-sum-exp: each group's stacked
    queries ``[members x heads, D]`` against its shared blocks once, each row against its own blocks
    after them (its whole context outside a group). Float32 ``[T, heads, D]``. `bf16_products`: the shared
    parts as `paged_attention`'s bf16 products (the own parts stay float32, as the native decode kernel's)."""
    num_rows, num_heads, head_dim = queries.shape
    block_size, num_kv_heads = key_blocks.shape[1], key_blocks.shape[2]
    group = num_heads // num_kv_heads
    q = queries.float()
    # Own part: row t's tokens [row_shared_blocks[t] * block_size, context_lens[t]).
    own_lens = context_lens - plan.row_shared_blocks * block_size
    own_width = max(1, -(-int(own_lens.max()) // block_size)) if num_rows else 1
    columns = plan.row_shared_blocks.unsqueeze(1) + torch.arange(own_width, device=queries.device).unsqueeze(0)
    own_tables = block_tables.gather(1, columns.clamp(max=block_tables.shape[1] - 1))  # past the end: masked
    own_out, own_lse = _attend_with_lse(q, key_blocks, value_blocks, own_tables, own_lens, scale)
    # Shared part: per group, every member's heads of one KV head stacked against the shared keys.
    for index in range(plan.num_groups):
        members = torch.tensor(plan.members(index), dtype=torch.long, device=queries.device)
        count = int(plan.group_shared_blocks[index])
        table = block_tables[members[0], :count]
        keys = key_blocks.index_select(0, table).reshape(-1, num_kv_heads, head_dim).float()  # [L, kv, D]
        values = value_blocks.index_select(0, table).reshape(-1, num_kv_heads, head_dim).float()
        stacked = q[members].view(len(members), num_kv_heads, group, head_dim).transpose(0, 1)
        stacked = stacked.reshape(num_kv_heads, len(members) * group, head_dim)  # [kv, members x G, D]
        if bf16_products:
            scores = torch.matmul(_bf16(stacked * scale), keys.permute(1, 2, 0))  # [kv, members x G, L]
        else:
            scores = torch.matmul(stacked, keys.permute(1, 2, 0)) * scale
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if bf16_products:
            unnormalised = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
            probs = _bf16(unnormalised) / unnormalised.sum(dim=-1, keepdim=True)
        out = torch.matmul(probs, values.transpose(0, 1))  # [kv, members x G, D]
        out = out.view(num_kv_heads, len(members), group, head_dim).transpose(0, 1).reshape(-1, num_heads, head_dim)
        lse = lse.view(num_kv_heads, len(members), group).transpose(0, 1).reshape(-1, num_heads)
        merged_lse = torch.logaddexp(own_lse[members], lse)
        own_out[members] = (own_out[members] * torch.exp(own_lse[members] - merged_lse).unsqueeze(-1)
                            + out * torch.exp(lse - merged_lse).unsqueeze(-1))
        own_lse[members] = merged_lse
    return own_out


def _attend_with_lse(
    queries: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor, block_tables: torch.Tensor,
    lengths: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row t attends to the first ``lengths[t]`` tokens of ``block_tables[t]`` (0 tokens: output 0 and
    log-sum-exp -inf, so a merge ignores it). Returns (``[T, heads, D]``, ``[T, heads]``)."""
    num_rows, num_heads, head_dim = queries.shape
    num_kv_heads = key_blocks.shape[2]
    keys = key_blocks.index_select(0, block_tables.reshape(-1)).view(num_rows, -1, num_kv_heads, head_dim)
    values = value_blocks.index_select(0, block_tables.reshape(-1)).view(num_rows, -1, num_kv_heads, head_dim)
    keys = keys.float().repeat_interleave(num_heads // num_kv_heads, dim=2)  # [T, L, heads, D]
    values = values.float().repeat_interleave(num_heads // num_kv_heads, dim=2)
    scores = torch.einsum("thd,tlhd->thl", queries, keys) * scale
    mask = torch.arange(keys.shape[1], device=queries.device).unsqueeze(0) < lengths.unsqueeze(1)  # [T, L]
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for an empty row
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(torch.float32).min).unsqueeze(-1))
    return torch.einsum("thl,tlhd->thd", probs, values), lse
