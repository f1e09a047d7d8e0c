"""The per-step adapter context the model reads: rows grouped by slot, and the registry's slot tensors.

llama.py calls `LayerLoRA.add(out, x, proj)` right after each projection's base matmul; the update is
`sgmv.add_lora` (one pair of small matmuls per adapter present in the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.lora.sgmv import RowGroups, add_lora, group_rows


@dataclass(slots=True)
class LayerLoRA:
    """One layer's view of the step's adapters."""

    groups: RowGroups
    a: dict[str, torch.Tensor]  # proj -> [slots, in, width] of this layer
    b: dict[str, torch.Tensor]

    def add(self, out: torch.Tensor, x: torch.Tensor, proj: str) -> None:
        """``out += x @ A @ B`` for each row under an adapter (proj: qkv | o | gate_up | down)."""
        add_lora(out, x, self.groups, self.a[proj], self.b[proj])


@dataclass(slots=True)
class LoRABatch:
    """The step's rows grouped by adapter slot plus the stacked slot weights of every layer."""

    groups: RowGroups
    a: dict[str, torch.Tensor]  # proj -> [layers, slots, in, width]
    b: dict[str, torch.Tensor]

    @classmethod
    def build(cls, row_slots: torch.Tensor, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> LoRABatch | None:
        """None when no row uses an adapter (the model then runs exactly as without LoRA)."""
        groups = group_rows(row_slots)
        return None if groups.empty else cls(groups, a, b)

    def for_layer(self, index: int) -> LayerLoRA:
        a = {proj: stacked[index] for proj, stacked in self.a.items()}
        b = {proj: stacked[index] for proj, stacked in self.b.items()}
        return LayerLoRA(self.groups, a, b)
