"""The KV pool: one preallocated tensor holding every layer's key/value blocks.

A large pool lives in an anonymous memory mapping: the OS hands out its pages zero-filled and commits
them when first written, so a 2 GiB pool costs nothing at start-up (torch.zeros would touch every page,
about a fifth of a cold start) and unused blocks never take RAM -- and no block is ever uninitialised
(a padded decode gathers whole blocks and masks the unwritten slots; garbage NaNs there would leak through
the masked softmax, zeros cannot).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

LAZY_POOL_BYTES = 64 * 1024 * 1024  # below this, torch.zeros is cheap and simpler


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
        dims = (shape.num_layers, 2, shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        nbytes = shape.bytes_per_block(dtype) * shape.num_blocks
        self._mapping: mmap.mmap | None = None
        if torch.device(device).type == "cpu" and nbytes >= LAZY_POOL_BYTES:
            # Anonymous and private (Python's default is MAP_SHARED: shmem pages, swappable only as shmem and
            # shared with any forked child): zero-filled pages on first touch.
            self._mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.tensor = torch.frombuffer(self._mapping, dtype=dtype, count=nbytes // dtype.itemsize).view(dims)
        else:
            self.tensor = torch.zeros(dims, dtype=dtype, device=device)

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
