"""The exact block index fed by KV events: block hash → {worker: tier}.

Each worker's events keep its entries true: `BlockStored` adds, `BlockRemoved` drops,
`AllBlocksCleared` (or a lost stream, or a restart) clears that worker. A request's score on a worker
is its longest run of leading blocks that worker holds: attention needs the whole prefix, so a block
after a hole is useless.

Events name their tier (`medium`): the device pool's ("GPU") and, below it, the worker's host RAM ("CPU")
and local disk ("DISK"), which a kvserve worker loads back from at admission instead of computing. The
device's entries are the index itself; each lower medium has a sub-index of its own (`lower(medium)`),
because a block can be in several at once (a host copy stays when the block is loaded back to the device;
a disk hit is promoted into host) and each medium's `BlockRemoved` takes it out of that medium only.
`AllBlocksCleared` clears the device's entries (a worker's prefix-cache reset keeps its tiers, which report
their own removals); a lost stream, a restart or a worker leaving clears every medium.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvserve.events.format import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class BlockIndex:
    """hash → the workers holding it, for one medium (the device's, unless made by `lower`); worker keys are
    any hashables (the router uses worker URLs)."""

    def __init__(self, medium: str = MEDIUM_GPU) -> None:
        self.medium = medium
        self._holders: dict[bytes, set[Hashable]] = {}
        self._by_worker: dict[Hashable, set[bytes]] = {}
        self._lower: dict[str, BlockIndex] = {}  # the device index's sub-indexes, one per lower medium

    def holds(self, worker: Hashable, block_hash: bytes) -> bool:
        return block_hash in self._by_worker.get(worker, ())

    def holds_lower(self, worker: Hashable, block_hash: bytes) -> bool:
        """Whether one of the worker's lower tiers (host RAM, disk) holds the block."""
        return any(index.holds(worker, block_hash) for index in self._lower.values())

    def lower(self, medium: str) -> BlockIndex:
        """The sub-index of a lower medium (made on first use)."""
        index = self._lower.get(medium)
        if index is None:
            index = self._lower[medium] = BlockIndex(medium)
        return index

    def num_blocks(self, worker: Hashable) -> int:
        return len(self._by_worker.get(worker, ()))

    def sizes(self) -> list[tuple[Hashable, str, int]]:
        """(worker, medium, blocks) for every worker with entries, the device's first."""
        sizes = [(worker, self.medium, len(owned)) for worker, owned in self._by_worker.items()]
        for index in self._lower.values():
            sizes += index.sizes()
        return sizes

    def store(self, worker: Hashable, hashes: Sequence[bytes], medium: str = MEDIUM_GPU) -> None:
        if medium != self.medium:
            self.lower(medium).store(worker, hashes, medium)
            return
        owned = self._by_worker.setdefault(worker, set())
        for block_hash in hashes:
            self._holders.setdefault(block_hash, set()).add(worker)
            owned.add(block_hash)

    def remove(self, worker: Hashable, hashes: Sequence[bytes], medium: str = MEDIUM_GPU) -> None:
        if medium != self.medium:
            if medium in self._lower:
                self._lower[medium].remove(worker, hashes, medium)
            return
        owned = self._by_worker.get(worker)
        if not owned:
            return
        for block_hash in hashes:
            if block_hash in owned:
                owned.discard(block_hash)
                self._drop(block_hash, worker)

    def clear(self, worker: Hashable) -> None:
        """Forget everything the worker holds, in every medium (a lost stream, a restart, leaving)."""
        self.clear_medium(worker)
        for index in self._lower.values():
            index.clear(worker)

    def clear_medium(self, worker: Hashable) -> None:
        """Forget the worker's entries of this index's own medium only (`AllBlocksCleared`)."""
        for block_hash in self._by_worker.pop(worker, set()):
            self._drop(block_hash, worker)

    def _drop(self, block_hash: bytes, worker: Hashable) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[block_hash]

    def apply(self, worker: Hashable, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.store(worker, event.block_hashes, event.medium or MEDIUM_GPU)
            elif isinstance(event, BlockRemoved):
                self.remove(worker, event.block_hashes, event.medium or MEDIUM_GPU)
            elif isinstance(event, AllBlocksCleared):
                self.clear_medium(worker)

    def longest_runs(self, hashes: Sequence[bytes], workers: Sequence[Hashable]) -> dict[Hashable, int]:
        """For each worker, how many leading `hashes` it holds without a gap."""
        runs = dict.fromkeys(workers, 0)
        alive = set(workers)
        for i, block_hash in enumerate(hashes):
            holders = self._holders.get(block_hash, ())
            for worker in [w for w in alive if w not in holders]:
                runs[worker] = i
                alive.discard(worker)
            if not alive:
                break
        else:
            for worker in alive:
                runs[worker] = len(hashes)
        return runs

    def check_invariants(self) -> None:
        for index in self._lower.values():
            index.check_invariants()
        for worker, owned in self._by_worker.items():
            for block_hash in owned:
                assert worker in self._holders.get(block_hash, ()), "worker owns a hash the index lost"
        for block_hash, holders in self._holders.items():
            assert holders, "empty holder set kept"
            for worker in holders:
                assert block_hash in self._by_worker.get(worker, ()), "holder does not own the hash"


class PendingBlocks:
    """Blocks the router has just sent a worker to compute, before its BlockStored events arrive.

    Events lag the routing decision by a whole queue wait and prefill; without this, every request
    for a hot prefix that arrives in that window looks uncached everywhere and is spread by load, so
    the prefix gets computed on several workers. An entry lives `ttl` seconds (or until the worker
    reports the block stored or removed)."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._expiry: dict[Hashable, dict[bytes, float]] = {}
        self._sweep_at: dict[Hashable, int] = {}  # sweep a worker's entries when they grow past this

    def add(self, worker: Hashable, hashes: Sequence[bytes], now: float) -> None:
        entries = self._expiry.setdefault(worker, {})
        for block_hash in hashes:
            entries[block_hash] = now + self.ttl
        if len(entries) > self._sweep_at.get(worker, 1024):  # drop what expired; amortised O(1) per add
            entries = self._expiry[worker] = {h: t for h, t in entries.items() if t > now}
            self._sweep_at[worker] = max(1024, 2 * len(entries))

    def __len__(self) -> int:
        return sum(map(len, self._expiry.values()))

    def holds(self, worker: Hashable, block_hash: bytes, now: float) -> bool:
        return self._expiry.get(worker, {}).get(block_hash, 0.0) > now

    def settle(self, worker: Hashable, batch: KVEventBatch) -> None:
        """The worker reported on these blocks' device copies: the index is the truth for them now."""
        entries = self._expiry.get(worker)
        if not entries:
            return
        for event in batch.events:
            if isinstance(event, (BlockStored, BlockRemoved)) and (event.medium or MEDIUM_GPU) == MEDIUM_GPU:
                for block_hash in event.block_hashes:
                    entries.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                entries.clear()

    def clear(self, worker: Hashable) -> None:
        self._expiry.pop(worker, None)
        self._sweep_at.pop(worker, None)


@dataclass(slots=True)
class WorkerEvents:
    """The event handler for one worker: applies its batches to the shared index under its key."""

    index: BlockIndex
    worker: Hashable
    pending: PendingBlocks | None = None
    resets: int = 0

    def apply(self, batch: KVEventBatch) -> None:
        self.index.apply(self.worker, batch)
        if self.pending is not None:
            self.pending.settle(self.worker, batch)

    def reset(self, reason: str) -> None:
        self.resets += 1
        self.index.clear(self.worker)
