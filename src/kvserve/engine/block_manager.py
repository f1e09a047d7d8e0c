"""BlockManager: a request's block table, grown as tokens arrive, shared through the prefix cache.

It composes the allocator (free blocks, reference counts) with a prefix cache (registered blocks),
and is the only place the engine touches either. Checks (`can_*`) have no side effects.
Forked sequences share blocks; the shared tail block is copied on write (see fork.py).
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.engine.fork import copy_tail_on_write, tail_is_shared
from kvserve.engine.request import Request
from kvserve.kv.block_allocator import BlockAllocator
from kvserve.prefix.base import PrefixCache
from kvserve.prefix.hashing import extend_block_hashes


class BlockManager:
    def __init__(
        self, allocator: BlockAllocator, prefix_cache: PrefixCache, block_size: int,
        caching_enabled: bool, hash_algo: str = "sha256",
    ) -> None:
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.block_size = block_size
        self.caching_enabled = caching_enabled
        self.hash_algo = hash_algo
        self.peak_used_blocks = 0
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the next forward
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

    # --- prefix matching -------------------------------------------------------------------------

    def match_prefix(self, request: Request) -> list[int]:
        """Cached blocks for the request's leading whole blocks, leaving >= 1 token to compute."""
        if not self.caching_enabled:
            return []
        num_usable_blocks = (request.num_tokens - 1) // self.block_size
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
        request.num_computed_tokens = len(matched) * self.block_size
        request.num_published_blocks = len(matched)

    def adopt_cached_continuation(self, request: Request) -> int:
        """A request still prefilling takes the next blocks another request has cached since it was admitted.

        Two requests with one long prefix often arrive together: both are admitted before either has
        published anything. At a block boundary the later one re-matches and skips what the other
        computed meanwhile. Returns the number of tokens adopted (0 when nothing applies).
        """
        if not self.caching_enabled or request.group is not None:
            return 0
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
        request.num_computed_tokens += len(extra) * self.block_size
        request.num_published_blocks = len(request.block_table)
        return len(extra) * self.block_size

    def can_grow(self, request: Request, num_new_tokens: int) -> bool:
        num_needed = self._num_missing_blocks(request, num_new_tokens)
        if request.may_share_tail:  # forked: writing a shared tail block takes a copy first
            num_needed += tail_is_shared(self, request)
        return num_needed <= self.num_available_blocks()

    def grow(self, request: Request, num_new_tokens: int) -> None:
        """Allocate blocks so the next `num_new_tokens` tokens have slots; evicts cached blocks if needed."""
        if request.may_share_tail:
            copy_tail_on_write(self, request)
        num_missing = self._num_missing_blocks(request, num_new_tokens)
        if num_missing <= 0:
            return
        if num_missing > self.allocator.num_free:
            self.prefix_cache.evict(num_missing - self.allocator.num_free)
        request.block_table.extend(self.allocator.allocate(num_missing))
        self.peak_used_blocks = max(self.peak_used_blocks, self.allocator.num_referenced())

    def _num_missing_blocks(self, request: Request, num_new_tokens: int) -> int:
        needed = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        return needed - len(request.block_table)

    # --- publishing and freeing ------------------------------------------------------------------

    def publish_full_blocks(self, request: Request) -> None:
        """Register every block whose KV is now complete, so later (and concurrent) requests hit it."""
        if not self.caching_enabled:
            return
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
        if self.on_stored is not None and num_present < num_full_blocks:
            parent = hashes[num_present - 1] if num_present else None
            self.on_stored(hashes[num_present:], parent, tokens[num_present * self.block_size :])
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

    def free(self, request: Request) -> None:
        """Drop the request's references, tail block first (so tails are evicted before heads)."""
        self.prefix_cache.release(request.block_table[::-1])
        request.block_table = []
        request.num_published_blocks = 0
        request.num_computed_tokens = 0

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> bool:
        return self.prefix_cache.reset()

    def num_used_blocks(self) -> int:
        return self.allocator.num_referenced()
