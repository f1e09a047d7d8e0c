"""Block allocator: a free list plus one reference count per block.

A block is *free* (on the free list, ref 0), *referenced* (ref > 0, held by requests), or
*cached* (ref 0, not on the free list: the prefix cache keeps it for reuse until it evicts it).
The allocator only knows free and referenced; the prefix cache owns the cached state.
"""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Hands out block ids of one pool and counts references to them."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free: list[bool] = [True] * num_blocks
        self._num_referenced = 0  # kept incrementally: read every step for stats

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, block_id: int) -> bool:
        return self._is_free[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks, each with one reference."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"cannot allocate {num_blocks} blocks: only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in blocks:
            self._is_free[block_id] = False
            self.ref_counts[block_id] = 1
        self._num_referenced += num_blocks
        return blocks

    def incref(self, block_id: int) -> int:
        if self._is_free[block_id]:
            raise RuntimeError(f"incref of free block {block_id}")
        self.ref_counts[block_id] += 1
        if self.ref_counts[block_id] == 1:
            self._num_referenced += 1
        return self.ref_counts[block_id]

    def decref(self, block_id: int) -> int:
        """Drop one reference; returns the new count. The block is not freed here."""
        if self.ref_counts[block_id] <= 0:
            raise RuntimeError(f"decref of unreferenced block {block_id}")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self._num_referenced -= 1
        return self.ref_counts[block_id]

    def free(self, block_id: int) -> None:
        """Return an unreferenced block to the free list."""
        if self.ref_counts[block_id] != 0:
            raise RuntimeError(f"free of block {block_id} with {self.ref_counts[block_id]} references")
        if self._is_free[block_id]:
            raise RuntimeError(f"double free of block {block_id}")
        self._is_free[block_id] = True
        self._free.append(block_id)

    def num_referenced(self) -> int:
        """Blocks with at least one reference (O(1))."""
        return self._num_referenced
