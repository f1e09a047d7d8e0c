"""The groups a cascade (shared-prefix) attention call runs with, as tensors, and their checks.

`kv/cascade.py` finds the groups once per step (decode rows whose block tables start with the same
physical blocks); every layer then passes the same `CascadeTensors` to the kernel. The native kernel
takes raw pointers, so the plan is checked against the rows, tables and context lengths before the
first call -- once per (plan, tables) pair, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CASCADE_FIELDS = ("group_offsets", "group_rows", "group_shared_blocks", "row_shared_blocks")


@dataclass(slots=True)
class CascadeTensors:
    """Rows ``group_rows[group_offsets[i]:group_offsets[i + 1]]`` share their first
    ``group_shared_blocks[i]`` blocks; ``row_shared_blocks[t]`` is that count for row t (0 outside a group)."""

    group_offsets: torch.Tensor  # [num_groups + 1], int64
    group_rows: torch.Tensor  # [rows in groups], int64
    group_shared_blocks: torch.Tensor  # [num_groups], int64
    row_shared_blocks: torch.Tensor  # [num_rows], int64
    checked_with: tuple[torch.Tensor, torch.Tensor] | None = None  # the tables / lengths last checked

    @property
    def num_groups(self) -> int:
        return self.group_shared_blocks.shape[0]

    def members(self, group: int) -> list[int]:
        start, end = int(self.group_offsets[group]), int(self.group_offsets[group + 1])
        return self.group_rows[start:end].tolist()


def check_cascade_plan(
    plan: CascadeTensors, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_rows: int
) -> None:
    """ValueError unless the plan describes groups of distinct rows whose tables really start with the
    same blocks, each covered by every member's context, and the per-row counts agree."""
    if plan.checked_with is not None and plan.checked_with[0] is block_tables and plan.checked_with[1] is context_lens:
        return
    if block_tables.dim() != 2 or block_tables.shape[0] != num_rows or context_lens.shape != (num_rows,):
        raise ValueError("block_tables must be [rows, max_blocks] and context_lens [rows]")
    if num_rows and (int(context_lens.min()) < 1 or int(context_lens.max()) > block_tables.shape[1] * block_size):
        raise ValueError("a context length is < 1 or exceeds its block table")
    offsets, rows, shared = plan.group_offsets.tolist(), plan.group_rows.tolist(), plan.group_shared_blocks.tolist()
    if len(offsets) != len(shared) + 1 or offsets[0] != 0 or offsets[-1] != len(rows):
        raise ValueError("group_offsets must run from 0 to len(group_rows), one more entry than groups")
    if any(b < a for a, b in zip(offsets, offsets[1:], strict=False)) or len(set(rows)) != len(rows):
        raise ValueError("groups must be disjoint runs of group_rows")
    if any(not 0 <= row < num_rows for row in rows):
        raise ValueError(f"a group row is outside [0, {num_rows})")
    expected = [0] * num_rows
    for group, count in enumerate(shared):
        members = rows[offsets[group] : offsets[group + 1]]
        if count < 1 or not members:
            raise ValueError("every group shares at least one block and has a member")
        if any(int(context_lens[row]) < count * block_size for row in members):
            raise ValueError("a group's shared blocks exceed a member's context")
        head = block_tables[members[0], :count]
        if any(not torch.equal(block_tables[row, :count], head) for row in members[1:]):
            raise ValueError("a group's members do not start with the same blocks")
        for row in members:
            expected[row] = count
    if plan.row_shared_blocks.shape != (num_rows,) or plan.row_shared_blocks.tolist() != expected:
        raise ValueError("row_shared_blocks does not match the groups")
    plan.checked_with = (block_tables, context_lens)
