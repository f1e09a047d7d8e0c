"""HashCache: vLLM's automatic prefix caching (block hash -> cached block).

A cached block is found by its chained block hash (`kvserve.prefix.hashing`). The map tolerates
several blocks under one hash (hash -> {block_id: entry}): duplicates of one content registered at
different times, or genuine collisions. A hash is only an index, never trusted: every hit compares the
stored token ids, the namespace and the *parent entry* (the cached block matched just before it).
Comparing tokens alone is not enough: if two different first blocks collided, every later hash of the
two chains would collide too, and block 1 of one chain would pass a token check for the other.

Evictable blocks (registered, ref 0) wait in an LRU free queue (an OrderedDict: O(1) append, O(1)
removal from the middle when a block is hit again, pop from the head when evicting). The engine
releases a finished request's blocks tail first, so its last blocks are the first to go and a shared
prefix, released last, outlives the branches built on it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvserve.kv.block_allocator import BlockAllocator
from kvserve.prefix.base import Namespace, check_accounting
from kvserve.prefix.hashing import HashFunction


@dataclass(slots=True, eq=False)
class CachedBlock:
    """One registered block: what it holds, and the cached block before it in its chain."""

    block_id: int
    block_hash: bytes
    tokens: tuple[int, ...]
    namespace: Namespace
    parent: CachedBlock | None  # None for a first block


class HashCache:
    """Prefix cache keyed by chained block hashes; see the module docstring."""

    def __init__(
        self, allocator: BlockAllocator, block_size: int, hash_algo: HashFunction | str = HashFunction.SHA256
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self.hash_algo = HashFunction(hash_algo)  # which hashes the engine must pass in
        self.num_evictions = 0
        self._by_hash: dict[bytes, dict[int, CachedBlock]] = {}
        self._entry_of: dict[int, CachedBlock] = {}  # registered block id -> entry
        self._free_queue: OrderedDict[int, None] = OrderedDict()  # evictable blocks, LRU first
        # Called with (block_id, block_hash) pairs before evicted (or reset) blocks are freed.
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None

    # ---- sizes -----------------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, referenced or not."""
        return len(self._entry_of)

    @property
    def num_evictable_blocks(self) -> int:
        """Registered blocks with ref count 0 (exactly the free queue)."""
        return len(self._free_queue)

    @property
    def num_protected_blocks(self) -> int:
        """Registered blocks some request references."""
        return len(self._entry_of) - len(self._free_queue)

    # ---- lookup ----------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], block_hashes: Sequence[bytes], namespace: Namespace) -> list[int]:
        """Blocks caching the longest run of whole leading blocks of `tokens`, walking `block_hashes`
        in order until the first miss. No side effects (recency lives in the free queue)."""
        return [entry.block_id for entry in self._walk(tokens, block_hashes, namespace)]

    def _walk(
        self, tokens: Sequence[int], block_hashes: Sequence[bytes], namespace: Namespace
    ) -> list[CachedBlock]:
        """Entries of the leading blocks that are cached, in order."""
        bs = self.block_size
        tokens = tokens if isinstance(tokens, tuple) else tuple(tokens)
        num_blocks = min(len(block_hashes), len(tokens) // bs)
        by_hash, found = self._by_hash, []
        parent: CachedBlock | None = None
        for i in range(num_blocks):
            candidates = by_hash.get(block_hashes[i])
            if candidates is None:
                break
            block_tokens = tokens[i * bs : (i + 1) * bs]
            for entry in candidates.values():
                # The hash only narrows the search; identity of content and chain decides.
                if entry.parent is parent and entry.tokens == block_tokens and entry.namespace == namespace:
                    break
            else:
                break
            found.append(entry)
            parent = entry
        return found

    # ---- registration ----------------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        block_hashes: Sequence[bytes],
        blocks: Sequence[int],
        namespace: Namespace,
    ) -> int:
        """Register `blocks` (block i holds tokens[i*bs:(i+1)*bs], hash block_hashes[i]); returns how
        many leading blocks were already present. Those keep their cached ids; the caller's duplicates
        are not registered (the caller swaps them for `match`'s ids)."""
        bs = self.block_size
        tokens = tokens if isinstance(tokens, tuple) else tuple(tokens)
        num_blocks = min(len(blocks), len(block_hashes), len(tokens) // bs)
        present = self._walk(tokens[: num_blocks * bs], block_hashes, namespace)
        for block_id in blocks[len(present) : num_blocks]:
            if block_id in self._entry_of:  # checked up front so a bad call registers nothing
                raise ValueError(f"block {block_id} is already registered")
        parent = present[-1] if present else None
        for i in range(len(present), num_blocks):
            parent = self._register(
                CachedBlock(blocks[i], block_hashes[i], tokens[i * bs : (i + 1) * bs], namespace, parent)
            )
        return len(present)

    def _register(self, entry: CachedBlock) -> CachedBlock:
        block_id = entry.block_id
        self._entry_of[block_id] = entry
        self._by_hash.setdefault(entry.block_hash, {})[block_id] = entry
        if self.allocator.ref_counts[block_id] == 0:
            self._free_queue[block_id] = None
        return entry

    def _unregister(self, block_id: int) -> bytes:
        entry = self._entry_of.pop(block_id)
        bucket = self._by_hash[entry.block_hash]
        del bucket[block_id]
        if not bucket:
            del self._by_hash[entry.block_hash]
        return entry.block_hash

    # ---- references ------------------------------------------------------------------------------

    def acquire(self, blocks: Sequence[int]) -> None:
        """One more reference to each block; a hit leaves the free queue in O(1)."""
        for block_id in blocks:
            if self.allocator.incref(block_id) == 1:
                self._free_queue.pop(block_id, None)

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block, in the given order: at 0 a registered block joins the
        free queue's tail (so pass a request's blocks tail first), an unregistered one is freed."""
        for block_id in blocks:
            if self.allocator.decref(block_id) != 0:
                continue
            if block_id in self._entry_of:
                self._free_queue[block_id] = None
            else:
                self.allocator.free(block_id)

    # ---- eviction --------------------------------------------------------------------------------

    def evict(self, num_blocks: int) -> list[int]:
        """Unregister and free up to `num_blocks` blocks from the head of the free queue (LRU)."""
        victims: list[tuple[int, bytes]] = []
        while len(victims) < num_blocks and self._free_queue:
            block_id, _ = self._free_queue.popitem(last=False)
            victims.append((block_id, self._unregister(block_id)))
        if self.on_evict is not None and victims:
            self.on_evict(victims)
        for block_id, _ in victims:
            self.allocator.free(block_id)
        self.num_evictions += len(victims)
        return [block_id for block_id, _ in victims]

    def reset(self) -> bool:
        """Unregister and free every block; refused (False) while a registered block is referenced."""
        if self.num_protected_blocks:
            return False
        if self.on_evict is not None and self._entry_of:
            self.on_evict([(block_id, entry.block_hash) for block_id, entry in self._entry_of.items()])
        for block_id in self._entry_of:
            self.allocator.free(block_id)
        self._by_hash.clear()
        self._entry_of.clear()
        self._free_queue.clear()
        return True

    # ---- checks (tests) --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Recount everything from the maps and the allocator; raises AssertionError on a mismatch."""
        refs, alloc = self.allocator.ref_counts, self.allocator
        seen: set[int] = set()
        for block_hash, bucket in self._by_hash.items():
            assert bucket, "empty hash bucket kept"
            for block_id, entry in bucket.items():
                assert entry.block_id == block_id and entry.block_hash == block_hash
                assert self._entry_of.get(block_id) is entry and block_id not in seen
                assert len(entry.tokens) == self.block_size
                assert not alloc.is_free(block_id), f"block {block_id} both free and registered"
                assert (block_id in self._free_queue) == (refs[block_id] == 0), "free queue out of sync"
                seen.add(block_id)
        assert seen == set(self._entry_of), "block map and hash map disagree"
        assert set(self._free_queue) <= seen, "unregistered block in the free queue"
        check_accounting(alloc, seen, len(self._free_queue))
