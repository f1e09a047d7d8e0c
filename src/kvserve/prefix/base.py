"""The interface both prefix caches implement, and the no-op cache for `--prefix-cache off`.

Ownership model (shared by every implementation):
- The `BlockAllocator` holds one reference count per block; it is the only refcount.
- A cache *registers* blocks (via `insert`). A registered block with ref 0 is *evictable*
  (counted in `num_evictable_blocks`), with ref > 0 it is protected.
- `acquire(blocks)` adds one reference to each block; `release(blocks)` drops one. When a
  block's count reaches 0 it becomes evictable if registered, else it goes back to the
  allocator's free list at once.
- `evict(n)` unregisters at least `n` evictable blocks when it can (fewer if not enough are
  evictable), returns them to the allocator's free list, and returns their ids.
- `on_evict` (an attribute, None by default): when set, `evict` and `reset` call it with the
  `(block_id, block_hash)` pairs they drop, *before* those blocks return to the free list, so a
  listener can still read the blocks' KV (the tiered cache copies it out; KV events publish
  BlockRemoved). It may be called several times per `evict`; it must not call back into the cache.
- Accounting invariant at every moment:
  allocator.num_free + cache.num_evictable_blocks + allocator.num_referenced() == num_blocks.
  `check_invariants()` recounts it (and each cache's own structure); the engine calls it after every
  step when `KVSERVE_DEBUG_CHECKS=1`, as the test suite does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvserve.kv.block_allocator import BlockAllocator
from kvserve.prefix.namespace import Namespace

__all__ = ["Namespace", "NoPrefixCache", "PrefixCache", "check_accounting"]


class PrefixCache(Protocol):
    """Longest-prefix reuse of whole KV blocks, scoped by namespace."""

    block_size: int
    num_evictions: int  # blocks evicted so far
    on_evict: Callable[[list[tuple[int, bytes]]], None] | None  # see the module docstring

    def match(self, tokens: Sequence[int], block_hashes: Sequence[bytes], namespace: Namespace) -> list[int]:
        """Blocks caching the longest run of whole leading blocks of `tokens`. Touches recency only."""
        ...

    def insert(
        self, tokens: Sequence[int], block_hashes: Sequence[bytes], blocks: Sequence[int], namespace: Namespace
    ) -> int:
        """Register `blocks` (block i holds tokens[i*bs:(i+1)*bs]); returns how many leading blocks
        were already present (with these or other block ids). Other ids already present stay the
        cached ones; the caller swaps its duplicates for them (see `match`)."""
        ...

    def acquire(self, blocks: Sequence[int]) -> None: ...

    def release(self, blocks: Sequence[int]) -> None: ...

    def evict(self, num_blocks: int) -> list[int]: ...

    @property
    def num_evictable_blocks(self) -> int: ...

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, referenced or not."""
        ...

    def reset(self) -> bool:
        """Drop every registered block; only allowed when none is referenced."""
        ...

    def check_invariants(self) -> None:
        """Recount the cache's structure and the pool accounting; AssertionError on a mismatch."""
        ...


def check_accounting(alloc: BlockAllocator, registered: set[int], num_evictable: int) -> None:
    """Shared by every cache: ref counts, free list and the accounting invariant."""
    refs = alloc.ref_counts
    assert all(count >= 0 for count in refs), "negative ref count"
    assert num_evictable == sum(1 for b in registered if refs[b] == 0), "evictable count drifted"
    for block_id in range(alloc.num_blocks):
        if alloc.is_free(block_id):
            assert refs[block_id] == 0, f"block {block_id} both free and referenced"
        else:
            assert refs[block_id] > 0 or block_id in registered, f"block {block_id} leaked (ref 0, not free)"
    assert alloc.num_free + num_evictable + alloc.num_referenced() == alloc.num_blocks, "accounting"


class NoPrefixCache:
    """`--prefix-cache off`: nothing is ever registered, released blocks are freed at once."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.num_evictions = 0
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None  # never called: nothing cached

    def match(self, tokens: Sequence[int], block_hashes: Sequence[bytes], namespace: Namespace) -> list[int]:
        return []

    def insert(
        self, tokens: Sequence[int], block_hashes: Sequence[bytes], blocks: Sequence[int], namespace: Namespace
    ) -> int:
        return 0

    def acquire(self, blocks: Sequence[int]) -> None:
        for block_id in blocks:
            self.allocator.incref(block_id)

    def release(self, blocks: Sequence[int]) -> None:
        for block_id in blocks:
            if self.allocator.decref(block_id) == 0:
                self.allocator.free(block_id)

    def evict(self, num_blocks: int) -> list[int]:
        return []

    @property
    def num_evictable_blocks(self) -> int:
        return 0

    @property
    def num_cached_blocks(self) -> int:
        return 0

    def reset(self) -> bool:
        return self.allocator.num_referenced() == 0

    def check_invariants(self) -> None:
        check_accounting(self.allocator, set(), 0)
