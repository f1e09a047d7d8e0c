"""Which decode rows share leading KV blocks: the groups cascade attention reads once (once per step).

Rows share a block when their block tables hold the same physical block id: a prefix matched in the
prefix cache, or the prompt of forked samples. Such a block was written once and is never written
again (a full block; a shared partly filled tail is copied before anyone writes it), so its keys are
the same for every sharer. Rows are grouped by their first block; a group shares the longest run of
leading blocks common to all its members, within every member's context. A group is used only when it
pays: at least `min_rows` rows sharing at least `min_blocks` blocks; otherwise its rows attend as usual.
"""

from __future__ import annotations

import torch

from kvserve.kernels.cascade_plan import CascadeTensors

MIN_CASCADE_ROWS = 2
MIN_CASCADE_BLOCKS = 4  # at 16 tokens a block: 64 shared tokens before one extra pass is worth it


def plan_cascade(
    block_tables: list[list[int]], context_lens: list[int], block_size: int,
    min_rows: int = MIN_CASCADE_ROWS, min_blocks: int = MIN_CASCADE_BLOCKS, device: torch.device | str = "cpu",
) -> CascadeTensors | None:
    """Groups of decode rows (by index) sharing leading blocks, or None when no group pays."""
    by_first: dict[int, list[int]] = {}
    for row, (table, context_len) in enumerate(zip(block_tables, context_lens, strict=True)):
        if context_len >= block_size * max(min_blocks, 1):
            by_first.setdefault(table[0], []).append(row)
    offsets, rows, shared = [0], [], []
    for members in by_first.values():
        if len(members) < min_rows:
            continue
        count = _common_blocks(block_tables, context_lens, members, block_size)
        if count < max(min_blocks, 1):
            continue
        rows.extend(members)
        offsets.append(len(rows))
        shared.append(count)
    if not shared:
        return None
    row_shared = [0] * len(block_tables)
    for group, count in enumerate(shared):
        for row in rows[offsets[group] : offsets[group + 1]]:
            row_shared[row] = count

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return CascadeTensors(tensor(offsets), tensor(rows), tensor(shared), tensor(row_shared))


def _common_blocks(block_tables: list[list[int]], context_lens: list[int], members: list[int], block_size: int) -> int:
    """Leading blocks identical in every member's table and full in every member's context."""
    limit = min(context_lens[row] // block_size for row in members)
    head = block_tables[members[0]]
    count = 0
    while count < limit and all(block_tables[row][count] == head[count] for row in members[1:]):
        count += 1
    return count
