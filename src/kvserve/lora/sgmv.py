"""The low-rank update of a mixed batch, grouped by adapter (Punica's SGMV, in torch).

Every row of the flat batch carries a slot index (-1: the base model, no update). The base matmul
runs once for the whole batch (in the model); this adds, for each adapter slot present in the step,
`x[rows] @ A[slot] @ B[slot]` to those rows only: one pair of small matmuls per distinct adapter,
never a pass over the whole batch per adapter. The rows are grouped once per step (`group_rows`)
and the grouping is reused by every projection of every layer.

`lora_delta_reference` is the per-row pure-torch twin the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RowGroups:
    """The batch's rows grouped by adapter slot: `slots[i]` owns the row indices `rows[i]`."""

    slots: list[int]
    rows: list[torch.Tensor | None]  # None: every row of the batch (no gather / scatter needed)

    @property
    def empty(self) -> bool:
        return not self.slots


def group_rows(row_slots: torch.Tensor) -> RowGroups:
    """Sort rows by slot once (stable), split into one segment per adapter slot; base rows (-1) dropped."""
    order = torch.argsort(row_slots, stable=True)
    sorted_slots = row_slots[order]
    unique, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    slots: list[int] = []
    rows: list[torch.Tensor] = []
    for slot, segment in zip(unique.tolist(), torch.split(order, counts.tolist()), strict=True):
        if slot >= 0:
            slots.append(int(slot))
            rows.append(None if len(segment) == len(row_slots) else segment)
    return RowGroups(slots, rows)


def add_lora(out: torch.Tensor, x: torch.Tensor, groups: RowGroups, a: torch.Tensor, b: torch.Tensor) -> None:
    """In place: ``out[rows] += x[rows] @ a[slot] @ b[slot]`` for each segment of `groups`.

    `a` is ``[slots, in, rank]`` and `b` ``[slots, rank, out]`` (scaling folded into `b`)."""
    for slot, rows in zip(groups.slots, groups.rows, strict=True):
        if rows is None:  # one adapter for the whole batch: no gather, and the add fused into the matmul
            out.addmm_(x @ a[slot], b[slot])
        else:
            out.index_add_(0, rows, (x.index_select(0, rows) @ a[slot]) @ b[slot])


def lora_delta_reference(x: torch.Tensor, row_slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row twin of `add_lora`: the update each row gets, computed one row at a time."""
    delta = torch.zeros(x.shape[0], b.shape[-1], dtype=x.dtype, device=x.device)
    for row, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            delta[row] = (x[row : row + 1] @ a[slot]) @ b[slot]
    return delta
