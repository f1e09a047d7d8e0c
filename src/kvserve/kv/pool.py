"""The KV pool: one preallocated tensor holding every layer's key/value blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class KVPoolShape:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * element_size


def num_blocks_for_memory(
    memory_bytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """How many blocks fit in `memory_bytes` (at least one)."""
    shape = KVPoolShape(num_layers, 1, block_size, num_kv_heads, head_dim)
    return max(1, memory_bytes // shape.bytes_per_block(dtype))


class KVPool:
    """``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` on the model's device/dtype.

    Slot ``s`` of a layer is token position ``s % block_size`` of block ``s // block_size``.
    """

    def __init__(self, shape: KVPoolShape, dtype: torch.dtype, device: torch.device | str) -> None:
        self.shape = shape
        self.tensor = torch.zeros(
            shape.num_layers, 2, shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim,
            dtype=dtype, device=device,
        )

    @property
    def num_blocks(self) -> int:
        return self.shape.num_blocks

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    def layer(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_blocks, value_blocks) of one layer, each ``[num_blocks, block_size, kv_heads, head_dim]``."""
        return self.tensor[layer_index, 0], self.tensor[layer_index, 1]

    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()
