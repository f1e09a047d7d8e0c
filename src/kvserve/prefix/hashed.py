"""HashCache: vLLM's automatic prefix caching (block hash -> cached block).

A cached block is found by its chained block hash (`kvserve.prefix.hashing`). The map tolerates
several blocks under one hash (hash -> {block_id: entry}): duplicates of one content registered at
different times, or genuine collisions. A hash is only an index, never trusted: every hit compares the
stored token ids, the namespace and the *parent entry* (the cached block matched just before it).
Comparing tokens alone is not enough: if two different first blocks collided, every later hash of the
two chains would collide too, and block 1 of one chain would pass a token check for the other.

Eviction is leaf-first, as in the radix cache: a block is a candidate only when it is registered,
unreferenced and no cached block names it as parent (`num_children == 0`), so a cached block's whole
chain is always cached and a shared prefix outlives the branches built on it. Which candidate goes
first is the `EvictionPolicy`'s choice (prefix/eviction.py; LRU by default).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvserve.kv.block_allocator import BlockAllocator
from kvserve.prefix.base import Namespace, check_accounting
from kvserve.prefix.eviction import EvictionPolicy
from kvserve.prefix.hashing import HashFunction


@dataclass(slots=True, eq=False)
class CachedBlock:
    """One registered block: what it holds, and the cached block before it in its chain."""

    block_id: int
    block_hash: bytes
    tokens: tuple[int, ...]
    namespace: Namespace
    parent: CachedBlock | None  # None for a first block
    depth: int  # 1 for a first block
    num_children: int = 0  # registered blocks whose parent this is
    last_access: float = 0.0  # eviction-policy state (see prefix/eviction.py)
    hits: int = 0
    hit_time: float = 0.0
    gap: float = math.inf
    priority: float = 0.0
    heap_stamp: float | None = None

    @property
    def num_blocks(self) -> int:
        return 1

    @property
    def tail_hash(self) -> bytes:
        return self.block_hash

    @property
    def head_hash(self) -> bytes:
        return self.block_hash

    @property
    def hashes(self) -> tuple[bytes]:
        return (self.block_hash,)


class HashCache:
    """Prefix cache keyed by chained block hashes; see the module docstring."""

    def __init__(
        self, allocator: BlockAllocator, block_size: int, hash_algo: HashFunction | str = HashFunction.SHA256,
        clock: Callable[[], float] = time.monotonic, policy: EvictionPolicy | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self.hash_algo = HashFunction(hash_algo)  # which hashes the engine must pass in
        self.num_evictions = 0
        self._by_hash: dict[bytes, dict[int, CachedBlock]] = {}
        self._entry_of: dict[int, CachedBlock] = {}  # registered block id -> entry
        self._num_evictable = 0
        self._clock = clock
        self.policy = policy if policy is not None else EvictionPolicy()
        self.policy.attach(allocator.num_blocks)
        # Called with (block_id, block_hash) pairs before evicted (or reset) blocks are freed.
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None

    # ---- sizes -----------------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, referenced or not."""
        return len(self._entry_of)

    @property
    def num_evictable_blocks(self) -> int:
        """Registered blocks with ref count 0."""
        return self._num_evictable

    @property
    def num_protected_blocks(self) -> int:
        """Registered blocks some request references."""
        return len(self._entry_of) - self._num_evictable

    # ---- lookup ----------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], block_hashes: Sequence[bytes], namespace: Namespace) -> list[int]:
        """Blocks caching the longest run of whole leading blocks of `tokens`, walking `block_hashes`
        in order until the first miss. Touches the matched blocks' recency."""
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
        if found:
            now, touch = self._clock(), self.policy.touch
            for entry in found:
                touch(entry, now)
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
            depth = parent.depth + 1 if parent is not None else 1
            parent = self._register(
                CachedBlock(blocks[i], block_hashes[i], tokens[i * bs : (i + 1) * bs], namespace, parent, depth)
            )
        return len(present)

    def _register(self, entry: CachedBlock) -> CachedBlock:
        block_id = entry.block_id
        self._entry_of[block_id] = entry
        self._by_hash.setdefault(entry.block_hash, {})[block_id] = entry
        if entry.parent is not None:
            entry.parent.num_children += 1
        self.policy.inserted(entry, self._clock())
        if self.allocator.ref_counts[block_id] == 0:
            self._num_evictable += 1
            self.policy.push(entry)
        return entry

    def _unregister(self, entry: CachedBlock) -> None:
        del self._entry_of[entry.block_id]
        bucket = self._by_hash[entry.block_hash]
        del bucket[entry.block_id]
        if not bucket:
            del self._by_hash[entry.block_hash]
        self._num_evictable -= 1
        parent = entry.parent
        if parent is not None:
            parent.num_children -= 1
            if self._is_candidate(parent):
                self.policy.push(parent)

    def _is_candidate(self, entry: CachedBlock) -> bool:
        """Registered, unreferenced, and a leaf of its chain."""
        return (
            entry.num_children == 0
            and self.allocator.ref_counts[entry.block_id] == 0
            and self._entry_of.get(entry.block_id) is entry
        )

    # ---- references ------------------------------------------------------------------------------

    def acquire(self, blocks: Sequence[int]) -> None:
        """One more reference to each block; a registered one stops being evictable and counts a hit."""
        entry_of, incref, hit = self._entry_of, self.allocator.incref, self.policy.hit
        for block_id in blocks:
            entry = entry_of.get(block_id)
            if entry is not None:
                hit(entry)
            if incref(block_id) == 1 and entry is not None:
                self._num_evictable -= 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block: at 0 a registered block becomes evictable (a candidate
        when it is a leaf), an unregistered one is freed."""
        entry_of, decref = self._entry_of, self.allocator.decref
        for block_id in blocks:
            if decref(block_id) != 0:
                continue
            entry = entry_of.get(block_id)
            if entry is None:
                self.allocator.free(block_id)
                continue
            self._num_evictable += 1
            if entry.num_children == 0:
                self.policy.push(entry)

    # ---- eviction --------------------------------------------------------------------------------

    def evict(self, num_blocks: int) -> list[int]:
        """Unregister and free `num_blocks` blocks (or every evictable one if fewer), leaves in the
        policy's order; returns their ids."""
        victims: list[tuple[int, bytes]] = []
        while len(victims) < num_blocks:
            entry = self.policy.pop()
            if entry is None:
                break
            if not self._is_candidate(entry):
                continue  # stale: pushed again when it becomes a candidate
            self.policy.evicted(entry, entry.block_hash)
            self._unregister(entry)
            victims.append((entry.block_id, entry.block_hash))
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
        self._num_evictable = 0
        self.policy.clear()
        return True

    # ---- checks (tests) --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Recount everything from the maps and the allocator; raises AssertionError on a mismatch."""
        alloc = self.allocator
        queued = self.policy.queued()
        children: dict[int, int] = {}
        seen: set[int] = set()
        for block_hash, bucket in self._by_hash.items():
            assert bucket, "empty hash bucket kept"
            for block_id, entry in bucket.items():
                assert entry.block_id == block_id and entry.block_hash == block_hash
                assert self._entry_of.get(block_id) is entry and block_id not in seen
                assert len(entry.tokens) == self.block_size
                assert not alloc.is_free(block_id), f"block {block_id} both free and registered"
                parent = entry.parent
                if parent is not None:
                    assert self._entry_of.get(parent.block_id) is parent, "cached block with an evicted parent"
                    assert entry.depth == parent.depth + 1, "depth drifted"
                    children[id(parent)] = children.get(id(parent), 0) + 1
                if self._is_candidate(entry):
                    assert id(entry) in queued, "evictable leaf missing from the eviction heap"
                seen.add(block_id)
        assert seen == set(self._entry_of), "block map and hash map disagree"
        for entry in self._entry_of.values():
            assert entry.num_children == children.get(id(entry), 0), "child count drifted"
        check_accounting(alloc, seen, self._num_evictable)
