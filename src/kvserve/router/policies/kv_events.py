"""kv_events: route by what the workers' caches really hold, as their KV events report it.

Per request the router recomputes the prompt's chained block hashes (`prefix/hashing.py`, with the
request's namespace and the workers' block size and hash function, learned from `/load`), finds each
worker's longest run of leading cached blocks in the exact index, and picks the worker of least
estimated time to first token (`EtaCost`, Dynamo's KV router cost in tokens of prefill):

    eta = uncached prompt tokens there + load_weight × (pending prefill there + overhead × requests there)

where pending prefill is the uncached prompt tokens of the requests this router sent there that have
not answered their first token yet. A prefix every worker holds (a shared system prompt) cancels out;
a conversation whose history only its own worker holds stays there until the work queued ahead of it
there outweighs recomputing that history elsewhere. (Earlier scores: cached fraction − load gap as a
fraction let a one-request gap outweigh a chat history and moved conversations, 7-9 points of hit rate
lost; uncached tokens + request-count gap × the mean uncached tokens of a request priced three queued
chat turns like three queued first reads, and kept requests behind a busy worker while the other idled:
chat p90 over 2 workers 1.1× round_robin's.) SGLang's imbalance guard comes first (max − min load above
`balance_abs` and max above `balance_rel` × min → the least loaded), but only for a hot prefix
(`HotPrefixes`: it brings its holders more traffic than the other workers get): it is what copies a
hot document or a shared system prompt from a busy worker to an idle one (then both hold it and load
splits it). One of 4 equally asked documents on 4 workers is not copied when its requests bunch up for
a moment: the copy would cost a full prefill to save one wait. Over a window, `ShareGuard` sends a
request away from a worker that served more than `max_share` of the recent ones while another has
fewer requests and no more prefill in flight (reason `share`; with `warm_copy`, a worker lacking the
prefix gets a duplicate that computes it while the request stays): affinity splits requests as the
prefixes' popularity does. Reasons: `cache_hit` (the chosen worker holds the most), `rebalance` (the queue outweighed a
better-cached worker), `least_load` (cached nowhere: the least estimated work).

Blocks the router sent a worker moments ago count as cached there until its events report them
(`PendingBlocks`), so a burst for one hot prefix is not spread before the first prefill finishes.
Without usable tokens (no tokenizer, bad body) or before a worker has said how it hashes, it routes
by load.

A worker's lower tiers count too: its events report the blocks its device evicted into host RAM (medium
"CPU") or disk ("DISK"), which it loads back at admission instead of computing them (`engine/kv_tiers.py`).
Past the device run, the run goes on through those tiers, each of their tokens counted at
`tier_fetch_cost` of computing it (default 0.1; 1 counts the device only, as before the tiers published):
without them a document demoted on its worker looked cached nowhere and went to the least loaded worker,
which computed it again.

The policy owns one event subscription per healthy worker that publishes events (its `/load` names
the endpoint); a (re)joining worker starts from an empty index entry and a fresh stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvserve.events.subscriber import EventStream
from kvserve.prefix.hashing import block_hashes
from kvserve.router.config import BALANCE_ABS, BALANCE_REL, MAX_SHARE, SHARE_MIN_SEEN, TIER_FETCH_COST
from kvserve.router.index import BlockIndex, PendingBlocks, WorkerEvents
from kvserve.router.keys import RouteKey
from kvserve.router.policies.base import (
    Decision,
    HotPrefixes,
    LoadTieBreaker,
    Policy,
    ShareGuard,
    is_imbalanced,
)
from kvserve.router.policies.eta import EtaCost
from kvserve.router.policies.store import SharedStore
from kvserve.router.workers import Worker

logger = logging.getLogger("kvserve.router")
PENDING_TTL_S = 30.0


@dataclass(slots=True)
class CachedRuns:
    """A prompt's leading cached tokens per worker (`KvEventsPolicy.cached_tokens`)."""

    held: dict[Worker, int]  # on its device, or just sent there
    reach: dict[Worker, int]  # held, then on through its host RAM and disk tiers
    published: dict[Worker, int]  # of reach, the leading tokens it reported stored in any medium


class KvEventsPolicy(Policy):
    name = "kv_events"

    def __init__(self, cost: EtaCost | None = None, balance_abs: int = BALANCE_ABS,
                 balance_rel: float = BALANCE_REL, max_share: float = MAX_SHARE,
                 store: SharedStore | None = None, tier_fetch_cost: float = TIER_FETCH_COST,
                 warm_copy: bool = True, share_min_seen: int = SHARE_MIN_SEEN) -> None:
        if not 0.0 <= tier_fetch_cost <= 1.0:
            raise ValueError(f"tier_fetch_cost must be in [0, 1], got {tier_fetch_cost}")
        self.tier_fetch_cost = tier_fetch_cost
        self.index = BlockIndex()
        self.pending = PendingBlocks(PENDING_TTL_S)
        self._last_hashes: tuple[RouteKey, dict[Worker, list[bytes]]] | None = None
        self.cost = cost or EtaCost()
        self.store = store or SharedStore()
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._ties = LoadTieBreaker()
        self.hot = HotPrefixes()
        self.shares = ShareGuard(max_share, warm_copy=warm_copy, min_seen=share_min_seen)
        self.streams: dict[Worker, EventStream] = {}
        self._tasks: dict[Worker, asyncio.Task] = {}
        self.handlers: dict[Worker, WorkerEvents] = {}
        self._running = False

    def choose(self, key: RouteKey, workers: list[Worker]) -> Decision:
        imbalanced = is_imbalanced(workers, self.balance_abs, self.balance_rel)
        cached = self.cached_tokens(key, workers)
        if cached is None:
            return Decision(self._ties.least_loaded(workers), "imbalance" if imbalanced else "unkeyed")
        local = {w: cached.held[w] + round((1.0 - self.tier_fetch_cost) * (cached.reach[w] - cached.held[w]))
                 for w in workers}
        if not self.store.applies(workers):
            return self._decide(key, workers, local, local, imbalanced)
        runs = self.store.effective(local, cached.published, cached.reach)
        return self.store.with_probe_hint(self._decide(key, workers, local, runs, imbalanced), (local, runs))

    def _decide(self, key: RouteKey, workers: list[Worker], held: dict[Worker, int], runs: dict[Worker, int],
                imbalanced: bool) -> Decision:
        """The imbalance guard, the estimate and the share guard over `runs` (what each worker holds or,
        over a shared store, can load; `held`: what it holds itself, its lower tiers counted at their fetch
        cost)."""
        assert key.tokens is not None
        best = max(runs.values())
        if imbalanced:
            emptiest = None if best else lambda w: (self.index.num_blocks(w.url),)  # a new prefix: spread it
            chosen = self._ties.least_loaded(workers, emptiest)
            target = runs[chosen]
            if self.hot.worth_copying(key, runs, target):
                return Decision(chosen, "imbalance", target)
        costs = self.cost.costs(len(key.tokens), runs)
        chosen = self._ties.least_loaded(EtaCost.cheapest(costs))
        reason = ("least_load" if best == 0 else "shared_store" if runs[chosen] > held[chosen]
                  else "rebalance" if runs[chosen] < best else "cache_hit")
        return self.shares.apply(Decision(chosen, reason, runs[chosen]), workers, runs, len(key.tokens),
                                 lambda length: self.hot.share(key, length))

    def cached_tokens(self, key: RouteKey, workers: list[Worker]) -> CachedRuns | None:
        """Per worker, in tokens of the prompt's leading blocks: what its device holds (or was just sent),
        what it can reach with its lower tiers after that, and of those the blocks it has reported stored in
        any medium (published: in its store, if it shares one); None when not computable. One pass."""
        hashes = self._hashes(key, workers)
        if not hashes:
            return None
        now = time.monotonic()
        runs = CachedRuns({}, {}, {})
        for worker in workers:
            device, lower, reported = self._walk(worker, hashes.get(worker, ()), now)
            size = worker.load.block_size or 0
            runs.held[worker], runs.reach[worker] = device * size, (device + lower) * size
            runs.published[worker] = reported * size
        return runs

    def _walk(self, worker: Worker, hashes: list[bytes], now: float) -> tuple[int, int, int]:
        """Blocks in the device run (indexed or pending), then in the lower tiers' run after it, and the
        leading ones of both that the worker reported (not merely sent)."""
        device = lower = reported = 0
        for block_hash in hashes:
            if not lower:
                indexed = self.index.holds(worker.url, block_hash)
                if indexed or self.pending.holds(worker.url, block_hash, now):
                    reported += indexed and reported == device
                    device += 1
                    continue
            if not self.index.holds_lower(worker.url, block_hash):
                break
            reported += reported == device + lower
            lower += 1
        return device, lower, reported

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

    def held_by(self, key: RouteKey, workers: list[Worker]) -> dict[Worker, int] | None:
        cached = self.cached_tokens(key, workers)
        return None if cached is None else cached.reach

    def on_routed(self, key: RouteKey, worker: Worker) -> None:
        self.hot.add(key)
        self.shares.add(worker)
        self.on_copied(key, worker)

    def on_copied(self, key: RouteKey, worker: Worker) -> None:
        hashes = self._hashes(key, [worker])  # the ones choose() computed, for the same key
        if worker in hashes:
            self.pending.add(worker.url, hashes[worker], time.monotonic())

    def index_sizes(self) -> list[tuple[str, str, int]]:
        return [(str(worker), medium, blocks) for worker, medium, blocks in self.index.sizes()]

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
