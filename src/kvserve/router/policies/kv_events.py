"""kv_events: route by what the workers' caches really hold, as their KV events report it.

Per request the router recomputes the prompt's chained block hashes (`prefix/hashing.py`, with the
request's namespace and the workers' block size and hash function, learned from `/load`), finds each
worker's longest run of leading cached blocks in the exact index, and scores

    score = cached fraction of the prompt − load_weight × (load − least load) / max(max load, load_scale)

where load is `Worker.load_score` (the requests this router has outstanding there, or the polled
running + waiting when higher: known at once, not a poll later). SGLang's imbalance guard comes first
(max − min load above `balance_abs` and max above `balance_rel` × min → the least loaded). With the
defaults (guard at 2 requests apart, weight 1, scale 4) the guard is what copies a hot document from a
busy worker to an idle one (then both hold it and load splits it); the load term weighs workers that
hold different amounts of a prompt: loads 2 / 0 cost the busier one 0.5, so a conversation whose
history is short next to a prefix both workers hold (a shared system prompt) moves to the idler worker
(reason `rebalance`), while one mostly cached only where it is stays.

Blocks the router sent a worker moments ago count as cached there until its events report them
(`PendingBlocks`), so a burst for one hot prefix is not spread before the first prefill finishes.
Without usable tokens (no tokenizer, bad body) or before a worker has said how it hashes, it routes
by load.

The policy owns one event subscription per healthy worker that publishes events (its `/load` names
the endpoint); a (re)joining worker starts from an empty index entry and a fresh stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

from kvserve.events.subscriber import EventStream
from kvserve.prefix.hashing import block_hashes
from kvserve.router.config import BALANCE_ABS, BALANCE_REL, LOAD_SCALE, LOAD_WEIGHT
from kvserve.router.index import BlockIndex, PendingBlocks, WorkerEvents
from kvserve.router.keys import RouteKey
from kvserve.router.policies.base import Decision, LoadTieBreaker, Policy, is_imbalanced, load_penalties
from kvserve.router.workers import Worker

logger = logging.getLogger("kvserve.router")
PENDING_TTL_S = 30.0


class KvEventsPolicy(Policy):
    name = "kv_events"

    def __init__(self, load_weight: float = LOAD_WEIGHT, balance_abs: int = BALANCE_ABS,
                 balance_rel: float = BALANCE_REL, load_scale: int = LOAD_SCALE) -> None:
        if load_weight < 0 or load_scale < 1:
            raise ValueError(f"load_weight must be >= 0 and load_scale >= 1, got {load_weight}, {load_scale}")
        self.index = BlockIndex()
        self.pending = PendingBlocks(PENDING_TTL_S)
        self._last_hashes: tuple[RouteKey, dict[Worker, list[bytes]]] | None = None
        self.load_weight = load_weight
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.load_scale = load_scale
        self._ties = LoadTieBreaker()
        self.streams: dict[Worker, EventStream] = {}
        self._tasks: dict[Worker, asyncio.Task] = {}
        self.handlers: dict[Worker, WorkerEvents] = {}
        self._running = False

    def choose(self, key: RouteKey, workers: list[Worker]) -> Decision:
        if is_imbalanced(workers, self.balance_abs, self.balance_rel):
            return Decision(self._ties.least_loaded(workers), "imbalance")
        runs = self.cached_tokens(key, workers)
        if not runs or max(runs.values()) == 0:
            return Decision(self._ties.least_loaded(workers), "unkeyed" if not runs else "least_load")
        assert key.tokens is not None
        penalties = load_penalties(workers, self.load_scale)
        scores = {worker: runs[worker] / len(key.tokens) - self.load_weight * penalties[worker] for worker in workers}
        best = max(scores.values())
        chosen = self._ties.least_loaded([worker for worker in workers if scores[worker] == best])
        if runs[chosen] < max(runs.values()):
            reason = "rebalance"  # load outweighed a better-cached worker
        else:
            reason = "cache_hit" if runs[chosen] else "least_load"
        return Decision(chosen, reason, runs[chosen])

    def cached_tokens(self, key: RouteKey, workers: list[Worker]) -> dict[Worker, int]:
        """Tokens of the prompt each worker holds (or was just sent) as leading blocks; {} when not
        computable."""
        hashes = self._hashes(key, workers)
        if not hashes:
            return {}
        now = time.monotonic()
        runs: dict[Worker, int] = {}
        for worker in workers:
            run = 0
            for block_hash in hashes.get(worker, ()):
                if not (self.index.holds(worker.url, block_hash) or self.pending.holds(worker.url, block_hash, now)):
                    break
                run += 1
            runs[worker] = run * (worker.load.block_size or 0)
        return runs

    def _hashes(self, key: RouteKey, workers: list[Worker]) -> dict[Worker, list[bytes]]:
        """The prompt's chained block hashes as each worker computes them (per block size and function)."""
        if not key.usable or not key.exact:
            return {}
        if self._last_hashes is not None and self._last_hashes[0] is key:
            return self._last_hashes[1]
        assert key.tokens is not None and key.namespace is not None
        by_layout: dict[tuple[int, str], list[bytes]] = {}
        hashes: dict[Worker, list[bytes]] = {}
        for worker in workers:
            size, algo = worker.load.block_size, worker.load.prefix_hash
            if size and algo:
                if (size, algo) not in by_layout:
                    by_layout[(size, algo)] = block_hashes(key.tokens, size, key.namespace, algo)
                hashes[worker] = by_layout[(size, algo)]
        self._last_hashes = (key, hashes)
        return hashes

    def on_routed(self, key: RouteKey, worker: Worker) -> None:
        hashes = self._hashes(key, [worker])  # the ones choose() computed, for the same key
        if worker in hashes:
            self.pending.add(worker.url, hashes[worker], time.monotonic())

    def on_join(self, worker: Worker) -> None:
        self._stop_stream(worker)
        self.index.clear(worker.url)
        self.pending.clear(worker.url)
        if self._running:
            self._start_stream(worker)

    def on_leave(self, worker: Worker) -> None:
        self._stop_stream(worker)
        self.index.clear(worker.url)
        self.pending.clear(worker.url)

    async def start(self) -> None:
        self._running = True

    async def stop(self) -> None:
        self._running = False
        for worker in list(self._tasks):
            self._stop_stream(worker)

    def _start_stream(self, worker: Worker) -> None:
        endpoint = worker.load.kv_events_endpoint
        if not endpoint:
            logger.warning("router: worker %s publishes no KV events; kv_events sees it as empty", worker.url)
            return
        handler = self.handlers[worker] = WorkerEvents(self.index, worker.url, self.pending)
        replay = worker.load.kv_events_replay_endpoint
        stream = EventStream(connectable(endpoint, worker.url), handler,
                             connectable(replay, worker.url) if replay else None)
        self.streams[worker] = stream
        self._tasks[worker] = asyncio.get_running_loop().create_task(stream.run())

    def _stop_stream(self, worker: Worker) -> None:
        self.streams.pop(worker, None)
        task = self._tasks.pop(worker, None)
        if task is not None:
            task.cancel()


def connectable(endpoint: str, worker_url: str) -> str:
    """A bind address (`tcp://*:5557`, `tcp://0.0.0.0:5557`) as the router must connect to it."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme == "tcp" and host in ("*", "0.0.0.0", "[::]", "::"):
        return f"tcp://{urlsplit(worker_url).hostname}:{port}"
    return endpoint
