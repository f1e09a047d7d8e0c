"""BlockManager: a request's block table, grown as tokens arrive, shared through the prefix cache.

It composes the allocator (free blocks, reference counts) with a prefix cache (registered blocks),
and is the only place the engine touches either; its own fields (pending copies, the peak) change
only through its methods. Checks (`can_*`) have no side effects. With `--prefix-cache off` the cache
is `NoPrefixCache`: nothing matches, nothing registers, and no code here asks whether caching is on.

Forked sequences share blocks (`fork`). Full blocks are never written again, so they stay shared;
the partly filled tail is the only block that will be written: the first sequence that writes it
while it is shared gets a private copy (`copy_tail_on_write`, a (src, dst) pair the engine copies on
the pool before the forward), and the last holder writes in place.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from kvserve.engine.request import Request
from kvserve.kv.block_allocator import BlockAllocator
from kvserve.prefix.base import PrefixCache
from kvserve.prefix.hashing import extend_block_hashes


class BlockManager:
    def __init__(
        self, allocator: BlockAllocator, prefix_cache: PrefixCache, block_size: int, hash_algo: str = "sha256",
    ) -> None:
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.block_size = block_size
        self.hash_algo = hash_algo
        self._peak_used_blocks = 0
        self._pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the next forward
        self._table_versions = itertools.count(1)  # every change to a block table takes the next number
        # Told (hashes, block ids) of blocks a forward has just completed and published (tiers: write-through).
        self.on_published: Callable[[list[bytes], list[int]], None] | None = None
        # Called with (new block hashes, parent hash or None, their tokens) when blocks enter the cache.
        self.on_stored: Callable[[list[bytes], bytes | None, list[int]], None] | None = None

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_available_blocks(self) -> int:
        """Blocks a request could get now: free ones plus unreferenced cached ones (evictable)."""
        return self.allocator.num_free + self.prefix_cache.num_evictable_blocks

    def _changed(self, request: Request) -> None:
        """Every edit of a block table ends here: a fresh `table_version` (unique across requests) lets the
        scheduler's `PoolShare` keep a group's block count until one of its tables changes."""
        request.table_version = next(self._table_versions)

    # --- prefix matching -------------------------------------------------------------------------

    def match_prefix(self, request: Request) -> list[int]:
        """Cached blocks for the request's leading whole blocks, leaving >= 1 token to compute."""
        num_usable_blocks = request.num_reusable_blocks(self.block_size)
        if num_usable_blocks == 0:
            return []
        num_usable_tokens = num_usable_blocks * self.block_size
        tokens = request.all_token_ids[:num_usable_tokens]
        self._hash_full_blocks(request, tokens)
        blocks = self.prefix_cache.match(tokens, request.block_hashes[:num_usable_blocks], request.namespace)
        return blocks[:num_usable_blocks]

    def _hash_full_blocks(self, request: Request, tokens: list[int]) -> None:
        extend_block_hashes(request.block_hashes, tokens, self.block_size, request.namespace, self.hash_algo)

    # --- admission and growth ----------------------------------------------------------------------

    def can_admit(self, request: Request, matched: list[int], num_new_tokens: int) -> bool:
        """Whether `matched` plus blocks for `num_new_tokens` more tokens can be held now."""
        num_needed = self.blocks_for_tokens(len(matched) * self.block_size + num_new_tokens) - len(matched)
        # Matched blocks that are unreferenced count as evictable now but stop being so once held.
        ref_counts = self.allocator.ref_counts
        num_matched_evictable = sum(1 for block_id in matched if ref_counts[block_id] == 0)
        return num_needed <= self.num_available_blocks() - num_matched_evictable

    def admit(self, request: Request, matched: list[int]) -> None:
        """Hold the matched blocks: the request starts computing after them."""
        self.prefix_cache.acquire(matched)
        request.block_table = list(matched)
        self._changed(request)
        request.num_computed_tokens = len(matched) * self.block_size
        request.num_published_blocks = len(matched)

    def adopt_cached_continuation(self, request: Request) -> int:
        """A request still prefilling takes the next blocks another request has cached since it was admitted.

        Two requests with one long prefix often arrive together: both are admitted before either has
        published anything. At a block boundary the later one re-matches and skips what the other
        computed meanwhile. Returns the number of tokens adopted (0 when nothing applies).
        """
        num_held = len(request.block_table)
        aligned = request.num_computed_tokens == num_held * self.block_size
        if not aligned or request.num_published_blocks != num_held or request.num_computed_tokens == 0:
            return 0
        if request.num_tokens - request.num_computed_tokens <= self.block_size:
            return 0  # nothing left that a whole cached block could cover
        matched = self.match_prefix(request)
        if len(matched) <= num_held or matched[:num_held] != request.block_table:
            return 0
        extra = matched[num_held:]
        self.prefix_cache.acquire(extra)
        request.block_table.extend(extra)
        self._changed(request)
        request.num_computed_tokens += len(extra) * self.block_size
        request.num_published_blocks = len(request.block_table)
        return len(extra) * self.block_size

    def can_grow(self, request: Request, num_new_tokens: int) -> bool:
        num_needed = self._num_missing_blocks(request, num_new_tokens)
        if request.may_share_tail:  # forked: writing a shared tail block takes a copy first
            num_needed += self._tail_is_shared(request)
        return num_needed <= self.num_available_blocks()

    def can_grow_from_free(self, request: Request, num_new_tokens: int) -> bool:
        """Whether growing needs only free blocks: no cached block evicted, no tail copy (speculative drafts,
        a guess that must not cost the prefix cache anything)."""
        missing = self._num_missing_blocks(request, num_new_tokens)
        return not request.may_share_tail and missing <= self.allocator.num_free

    def grow(self, request: Request, num_new_tokens: int) -> None:
        """Allocate blocks so the next `num_new_tokens` tokens have slots; evicts cached blocks if needed."""
        if request.may_share_tail:
            self.copy_tail_on_write(request)
        num_missing = self._num_missing_blocks(request, num_new_tokens)
        if num_missing <= 0:
            return
        if num_missing > self.allocator.num_free:
            self.prefix_cache.evict(num_missing - self.allocator.num_free)
        request.block_table.extend(self.allocator.allocate(num_missing))
        self._changed(request)
        self._note_peak()

    def _num_missing_blocks(self, request: Request, num_new_tokens: int) -> int:
        needed = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        return needed - len(request.block_table)

    # --- publishing and freeing ------------------------------------------------------------------

    def publish_full_blocks(self, request: Request) -> None:
        """Register every block whose KV is now complete, so later (and concurrent) requests hit it."""
        num_full_blocks = request.num_computed_tokens // self.block_size
        if num_full_blocks <= request.num_published_blocks:
            return
        tokens = request.all_token_ids[: num_full_blocks * self.block_size]
        self._hash_full_blocks(request, tokens)
        hashes = request.block_hashes[:num_full_blocks]
        num_present = self.prefix_cache.insert(
            tokens, hashes, request.block_table[:num_full_blocks], request.namespace
        )
        if num_present > request.num_published_blocks:
            self._adopt_cached_duplicates(request, tokens, hashes, num_present)
        if self.on_published is not None:
            start = max(request.num_published_blocks, num_present)  # blocks present before were sent by others
            if start < num_full_blocks:
                self.on_published(hashes[start:num_full_blocks], request.block_table[start:num_full_blocks])
        self._announce_stored(hashes, tokens, num_present, num_full_blocks)
        request.num_published_blocks = num_full_blocks

    def _adopt_cached_duplicates(
        self, request: Request, tokens: list[int], hashes: list[bytes], num_present: int
    ) -> None:
        """Another request cached the same blocks first: use its blocks and free our copies."""
        cached = self.prefix_cache.match(tokens[: num_present * self.block_size], hashes[:num_present],
                                         request.namespace)
        for index in range(request.num_published_blocks, min(num_present, len(cached))):
            own_block = request.block_table[index]
            if cached[index] != own_block:
                self.prefix_cache.acquire([cached[index]])
                self.prefix_cache.release([own_block])
                request.block_table[index] = cached[index]
                self._changed(request)

    def free(self, request: Request) -> None:
        """Drop the request's references, tail block first (so tails are evicted before heads)."""
        self.prefix_cache.release(request.block_table[::-1])
        request.block_table = []
        self._changed(request)
        request.num_published_blocks = 0
        request.num_computed_tokens = 0

    # --- loading blocks from the tiers (see engine/kv_tiers.py) -----------------------------------

    def hold_for_load(self, request: Request, matched: list[int], num_blocks: int) -> bool:
        """Hold `matched` and `num_blocks` fresh blocks after them as the request's table, for KV that a
        lower tier is about to fill; False (nothing held) when the pool cannot spare them now."""
        ref_counts = self.allocator.ref_counts
        num_matched_evictable = sum(1 for block_id in matched if ref_counts[block_id] == 0)
        if num_blocks > self.num_available_blocks() - num_matched_evictable:
            return False
        self.prefix_cache.acquire(matched)  # first, so making room below cannot evict them
        if num_blocks > self.allocator.num_free:
            self.prefix_cache.evict(num_blocks - self.allocator.num_free)
        request.block_table = list(matched) + self.allocator.allocate(num_blocks)
        self._changed(request)
        self._note_peak()
        return True

    def publish_loaded(self, request: Request, num_blocks: int) -> None:
        """The first `num_blocks` of the held table now hold the request's KV: register them in the prefix
        cache, then drop the hold (the request is admitted later through an ordinary device match)."""
        tokens = request.all_token_ids[: num_blocks * self.block_size]
        hashes = request.block_hashes[:num_blocks]
        num_present = self.prefix_cache.insert(tokens, hashes, request.block_table[:num_blocks], request.namespace)
        self._announce_stored(hashes, tokens, num_present, num_blocks)
        self.free(request)

    def _announce_stored(self, hashes: list[bytes], tokens: list[int], num_present: int, num_blocks: int) -> None:
        """`on_stored` (KV events) for the blocks [num_present, num_blocks) that just entered the cache."""
        if self.on_stored is not None and num_present < num_blocks:
            parent = hashes[num_present - 1] if num_present else None
            self.on_stored(hashes[num_present:num_blocks], parent, tokens[num_present * self.block_size :])

    # --- forks and copy-on-write --------------------------------------------------------------------

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares `parent`'s blocks: same table, one more reference each, same progress."""
        child.block_table = list(parent.block_table)
        self._changed(child)
        child.block_hashes = list(parent.block_hashes)  # hashes of full blocks: common history
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_published_blocks = parent.num_published_blocks  # so the cache sees shared blocks once
        self.prefix_cache.acquire(child.block_table)
        if child.block_table:
            parent.may_share_tail = child.may_share_tail = True

    def _tail_is_shared(self, request: Request) -> bool:
        """Whether the block the request writes next exists and is shared (so it must be copied first)."""
        index = request.num_computed_tokens // self.block_size
        table = request.block_table
        return index < len(table) and self.allocator.ref_counts[table[index]] > 1

    def copy_tail_on_write(self, request: Request) -> None:
        """Give the request a private copy of its shared tail block (needs one available block)."""
        request.may_share_tail = False  # after this the tail is private until the next fork
        if not self._tail_is_shared(request):
            return
        if self.allocator.num_free == 0:
            self.prefix_cache.evict(1)
        index = request.num_computed_tokens // self.block_size
        shared = request.block_table[index]
        private = self.allocator.allocate(1)[0]
        self._pending_copies.append((shared, private))
        self.prefix_cache.release([shared])  # still held by the other sharers: only the count drops
        request.block_table[index] = private
        self._changed(request)
        self._note_peak()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies queued since the last call; the caller runs them before the forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    @property
    def pending_copies(self) -> list[tuple[int, int]]:
        return list(self._pending_copies)

    # --- statistics and checks --------------------------------------------------------------------

    @property
    def peak_used_blocks(self) -> int:
        """Most blocks referenced at once since the start (or the last `reset_peak`)."""
        return self._peak_used_blocks

    def reset_peak(self) -> None:
        self._peak_used_blocks = self.allocator.num_referenced()

    def _note_peak(self) -> None:
        self._peak_used_blocks = max(self._peak_used_blocks, self.allocator.num_referenced())

    def check_invariants(self, holders: Iterable[Request]) -> None:
        """The cache's and the allocator's accounting, and that `holders` (every request holding blocks)
        account for every reference exactly; AssertionError on a mismatch."""
        self.prefix_cache.check_invariants()
        held: dict[int, int] = {}
        for request in holders:
            assert len(request.block_table) * self.block_size >= request.num_computed_tokens, (
                f"{request.request_id}: {len(request.block_table)} blocks cannot hold "
                f"{request.num_computed_tokens} computed tokens")
            assert request.num_published_blocks <= len(request.block_table), request.request_id
            for block_id in request.block_table:
                assert not self.allocator.is_free(block_id), f"{request.request_id} holds free block {block_id}"
                held[block_id] = held.get(block_id, 0) + 1
        refs = self.allocator.ref_counts
        for block_id, count in enumerate(refs):
            holders_of_block = held.get(block_id, 0)
            assert count == holders_of_block, f"block {block_id}: {count} references, {holders_of_block} holders"

    def reset_prefix_cache(self) -> bool:
        return self.prefix_cache.reset()

    def num_used_blocks(self) -> int:
        return self.allocator.num_referenced()
