"""The exact block index fed by KV events: block hash → {worker: tier}.

Each worker's events keep its entries true: `BlockStored` adds, `BlockRemoved` drops,
`AllBlocksCleared` (or a lost stream, or a restart) clears that worker. A request's score on a worker
is its longest run of leading blocks that worker holds: attention needs the whole prefix, so a block
after a hole is useless.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvserve.events.format import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class BlockIndex:
    """hash → {worker key: medium}; worker keys are any hashables (the router uses worker URLs)."""

    def __init__(self) -> None:
        self._holders: dict[bytes, dict[Hashable, str]] = {}
        self._by_worker: dict[Hashable, set[bytes]] = {}

    def num_blocks(self, worker: Hashable) -> int:
        return len(self._by_worker.get(worker, ()))

    def store(self, worker: Hashable, hashes: Sequence[bytes], medium: str = "GPU") -> None:
        owned = self._by_worker.setdefault(worker, set())
        for block_hash in hashes:
            self._holders.setdefault(block_hash, {})[worker] = medium
            owned.add(block_hash)

    def remove(self, worker: Hashable, hashes: Sequence[bytes]) -> None:
        owned = self._by_worker.get(worker)
        if not owned:
            return
        for block_hash in hashes:
            if block_hash in owned:
                owned.discard(block_hash)
                self._drop(block_hash, worker)

    def clear(self, worker: Hashable) -> None:
        for block_hash in self._by_worker.pop(worker, set()):
            self._drop(block_hash, worker)

    def _drop(self, block_hash: bytes, worker: Hashable) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.pop(worker, None)
            if not holders:
                del self._holders[block_hash]

    def apply(self, worker: Hashable, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.store(worker, event.block_hashes, event.medium or "GPU")
            elif isinstance(event, BlockRemoved):
                self.remove(worker, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear(worker)

    def longest_runs(self, hashes: Sequence[bytes], workers: Sequence[Hashable]) -> dict[Hashable, int]:
        """For each worker, how many leading `hashes` it holds without a gap."""
        runs = dict.fromkeys(workers, 0)
        alive = set(workers)
        for i, block_hash in enumerate(hashes):
            holders = self._holders.get(block_hash, {})
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
        for worker, owned in self._by_worker.items():
            for block_hash in owned:
                assert worker in self._holders.get(block_hash, {}), "worker owns a hash the index lost"
        for block_hash, holders in self._holders.items():
            assert holders, "empty holder set kept"
            for worker in holders:
                assert block_hash in self._by_worker.get(worker, ()), "holder does not own the hash"


@dataclass(slots=True)
class WorkerEvents:
    """The event handler for one worker: applies its batches to the shared index under its key."""

    index: BlockIndex
    worker: Hashable
    resets: int = 0

    def apply(self, batch: KVEventBatch) -> None:
        self.index.apply(self.worker, batch)

    def reset(self, reason: str) -> None:
        self.resets += 1
        self.index.clear(self.worker)
