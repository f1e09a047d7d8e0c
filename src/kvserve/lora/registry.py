"""The adapter registry: names -> adapters in host memory, and `max_loras` resident slots (LRU).

The model reads adapters from stacked slot tensors, one pair per fused projection of llama.py:
``a[proj]`` is ``[layers, slots, in, k * max_rank]`` and ``b[proj]`` ``[layers, slots, k * max_rank, out]``,
where a fused projection of k modules (qkv: 3, gate_up: 2) puts module j's A in rank columns
``[j * max_rank, j * max_rank + r)`` and its B in the same rows and its own output columns, so
``x @ a @ b`` gives each module's update in its own slice of the fused output. Unused rank columns and
untargeted modules stay zero.

An adapter becomes resident when a step needs it (`activate`), copied from host memory into the least
recently used slot. Slots are keyed by `adapter_id`: a request keeps its `LoRAAdapter`, so unloading a
name never breaks a request already running under it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvserve.lora.adapter import LoRAAdapter, LoRARequest, load_adapter, module_shapes
from kvserve.model.config import ModelConfig

FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(slots=True)
class SlotLayout:
    """Where module `module` sits in fused projection `proj`: its rank block and its output columns."""

    proj: str
    index: int
    out_start: int
    out_end: int


def _layouts(config: ModelConfig) -> dict[str, SlotLayout]:
    shapes = module_shapes(config)
    layouts = {}
    for proj, modules in FUSED_PROJECTIONS.items():
        start = 0
        for index, module in enumerate(modules):
            layouts[module] = SlotLayout(proj, index, start, start + shapes[module][1])
            start += shapes[module][1]
    return layouts


class LoRARegistry:
    """Loaded adapters by name and the resident slots the model reads; not thread-safe (engine thread)."""

    def __init__(
        self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        self.adapters: dict[str, LoRAAdapter] = {}
        self._resident: OrderedDict[str, int] = OrderedDict()  # adapter_id -> slot, least recent first
        self._free_slots = list(range(max_loras - 1, -1, -1))
        self.num_swaps = 0
        self._layouts = _layouts(config)
        shapes = module_shapes(config)
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for proj, modules in FUSED_PROJECTIONS.items():
            in_features = shapes[modules[0]][0]
            out_features = sum(shapes[m][1] for m in modules)
            width = len(modules) * max_rank
            self.a[proj] = torch.zeros(config.num_layers, max_loras, in_features, width, dtype=dtype, device=device)
            self.b[proj] = torch.zeros(config.num_layers, max_loras, width, out_features, dtype=dtype, device=device)

    # --- names -----------------------------------------------------------------------------------------

    def add(self, adapter: LoRAAdapter) -> None:
        if adapter.name in self.adapters:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded")
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, over --max-lora-rank {self.max_rank}"
            )
        self.adapters[adapter.name] = adapter

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Load a PEFT adapter from `path` and register it under `name`; ValueError naming the problem,
        nothing registered."""
        if name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        adapter = load_adapter(name, path, self.config, self.max_rank)
        self.add(adapter)
        return adapter

    def resolve(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter a `LoRARequest` names, loaded from its `lora_path` the first time the name is seen."""
        return self.adapters.get(lora_request.lora_name) or self.load(lora_request.lora_name, lora_request.lora_path)

    def remove(self, name: str) -> bool:
        """Forget the name (running requests keep their adapter); its slot is reused when needed."""
        return self.adapters.pop(name, None) is not None

    def get(self, name: str) -> LoRAAdapter | None:
        return self.adapters.get(name)

    # --- slots -----------------------------------------------------------------------------------------

    @property
    def resident_ids(self) -> list[str]:
        """Adapter ids in their slots, least recently used first."""
        return list(self._resident)

    def activate(self, adapters: list[LoRAAdapter]) -> dict[str, int]:
        """Make every adapter of one step resident; returns adapter_id -> slot. At most `max_loras`."""
        wanted = list(dict.fromkeys(adapter.adapter_id for adapter in adapters))
        if len(wanted) > self.max_loras:
            raise ValueError(f"{len(wanted)} adapters in one step, over --max-loras {self.max_loras}")
        by_id = {adapter.adapter_id: adapter for adapter in adapters}
        for adapter_id in wanted:
            if adapter_id in self._resident:
                self._resident.move_to_end(adapter_id)
                continue
            if not self._free_slots:
                victim = next(key for key in self._resident if key not in wanted)
                self._free_slots.append(self._resident.pop(victim))
            slot = self._free_slots.pop()
            self._write_slot(slot, by_id[adapter_id])
            self._resident[adapter_id] = slot
            self.num_swaps += 1
        return {adapter_id: self._resident[adapter_id] for adapter_id in wanted}

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for proj in FUSED_PROJECTIONS:
            self.a[proj][:, slot].zero_()
            self.b[proj][:, slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            place = self._layouts[module]
            start = place.index * self.max_rank
            columns = slice(start, start + adapter.rank)
            self.a[place.proj][layer, slot, :, columns] = a
            self.b[place.proj][layer, slot, columns, place.out_start : place.out_end] = b
