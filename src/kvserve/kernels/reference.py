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


def paged_attention(
    queries: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Row t of ``queries [T, heads, D]`` attends to the first ``context_lens[t]`` tokens of the blocks in
    ``block_tables[t]`` (pool layout ``[num_blocks, block_size, kv_heads, D]``). Float32 ``[T, heads, D]``.
    """
    num_rows, num_heads, head_dim = queries.shape
    num_kv_heads = key_blocks.shape[2]
    keys = key_blocks.index_select(0, block_tables.reshape(-1)).view(num_rows, -1, num_kv_heads, head_dim)
    values = value_blocks.index_select(0, block_tables.reshape(-1)).view(num_rows, -1, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    keys = keys.float().repeat_interleave(group, dim=2)  # [T, L, heads, D]
    values = values.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("thd,tlhd->thl", queries.float(), keys) * scale
    positions = torch.arange(keys.shape[1], device=queries.device)
    mask = positions.unsqueeze(0) < context_lens.unsqueeze(1)  # [T, L]
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    return torch.einsum("thl,tlhd->thd", torch.softmax(scores, dim=-1), values)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual): the norm in float32 as HF, the sum for the next add."""
    if residual is not None:
        x = x + residual
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype), x


def cascade_attention(
    queries: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, plan: CascadeTensors, scale: float,
) -> torch.Tensor:
    """`paged_attention`'s result computed in two parts merged by log-sum-exp: each group's stacked
    queries ``[members x heads, D]`` against its shared blocks once, each row against its own blocks
    after them (its whole context outside a group). Float32 ``[T, heads, D]``."""
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
        scores = torch.matmul(stacked, keys.permute(1, 2, 0)) * scale  # [kv, members x G, L]
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.softmax(scores, dim=-1), values.transpose(0, 1))  # [kv, members x G, D]
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
