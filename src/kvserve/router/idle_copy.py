"""Idle copies: while a worker idles, it computes what another worker has just answered.

Over 2 workers at half a request a second, cache-aware chat's TTFT p90 was turns queued on their
conversation's worker while the other worker idled (BENCHMARKS.md, router_admission_zen4): moving such a
turn costs its history (1,000-1,500 tokens on one CPU thread, more than the wait), and a share-guard copy made
at routing time lands on a busy worker and delays whoever queues there. An idle copy is made
ahead, in time nobody else uses: once a worker has answered a prompt (its first token), each idle worker
that lacks at least `IDLE_COPY_MIN_TOKENS` of it gets the prompt as a background request
(`x-kvserve-background`, `engine/background.py`): one token, computed only while that worker has nothing
else to run, 64 tokens a step, never evicting a cached block, never counted in this router's load. The
next turn then finds its history on both workers, and the policy's load term sends it to the free one.

A worker is idle when this router has nothing in flight there and its last poll showed nobody else's
requests. The router keeps the last `RECENT_PROMPTS` answered prompts and, whenever a prompt is answered, a
copy ends or a poll interval passes, gives each idle worker the most recent one it lacks and has not been tried
with: at most one copy in flight per worker, so copies never queue behind each other, and a worker that was
busy when a turn was answered still gets it once it idles. The copy is indexed there (`Policy.on_copied`)
once it answered 200; one that failed (the worker had no free blocks for it, 429, a transport error) is
not tried on that worker again. Workers sharing one machine's cores are not idle hardware: with `slots`
(`--idle-copy-slots`, set by `kvserve cluster`) copies start only while fewer workers than that are busy (4
one-thread workers on 2 cores copying whenever one idled took cores from the busy ones: chat's p90 fell from
3.1x round_robin's to 1.5x). A copy runs under the caller's own headers (API key, so the same tenant
namespace; `cache_salt` is in the body), so it can only ever serve that tenant's later requests. Copies
need a policy that knows what each worker holds (`Policy.held_by`: cache_aware, kv_events).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field

import httpx
from prometheus_client import Counter

from kvserve.router.handoff import copy_request
from kvserve.router.keys import RouteKey
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies.base import Policy
from kvserve.router.workers import Worker, WorkerPool
from kvserve.server.roles import BACKGROUND_HEADER, STORE_PROBE_HEADER

logger = logging.getLogger("kvserve.router")
IDLE_COPY_MIN_TOKENS = 128  # a worker lacking fewer of the prompt's tokens computes them on demand instead
IDLE_COPY_POLICIES = ("cache_aware", "kv_events")  # the ones that know what each worker holds
IDLE_COPY_TIMEOUT_S = 60.0  # a copy not answered by then is dropped (closing it aborts it on the worker)
RECENT_PROMPTS = 16  # answered prompts kept as copy candidates, the newest first


@dataclass(slots=True, eq=False)
class Answered:
    """A prompt a worker answered: what a copy of it sends, and the workers already tried with it."""

    key: RouteKey
    path: str
    body: bytes  # `handoff.copy_request`: one token, one choice, no stream, not the caller's request id
    headers: dict[str, str]
    tried: set[Worker]


@dataclass(slots=True)
class IdleCopies:
    """Sends idle copies (module docstring): one in flight per worker at most, newest prompts first."""

    client: httpx.AsyncClient
    policy: Policy
    metrics: RouterMetrics
    min_tokens: int = IDLE_COPY_MIN_TOKENS
    timeout_s: float = IDLE_COPY_TIMEOUT_S
    interval: float = 1.0  # seconds between looks for workers gone idle (the pool's poll interval)
    slots: int = 0  # workers sharing the cores: copies start only while fewer than this are busy (0: no limit)
    recent: deque[Answered] = field(default_factory=lambda: deque(maxlen=RECENT_PROMPTS))
    in_flight: dict[Worker, asyncio.Task] = field(default_factory=dict)

    def after_prefill(self, key: RouteKey, source: Worker, workers: list[Worker], path: str, parsed: dict,
                      headers: dict[str, str]) -> None:
        """`source` answered the request keyed `key`: keep it as a candidate, then feed the idle workers."""
        if key.tokens is None or len(key.tokens) < self.min_tokens:
            return
        body, sent = copy_request(parsed, {k: v for k, v in headers.items() if k.lower() != STORE_PROBE_HEADER})
        self.recent.append(Answered(key, path, body, sent | {BACKGROUND_HEADER: "1"}, {source}))
        self.pump(workers)

    def pump(self, workers: list[Worker]) -> None:
        """Give each idle worker with no copy in flight the newest answered prompt it lacks (if any), while
        fewer than `slots` workers are busy (with requests or copies) when they share the machine's cores."""
        busy = sum(worker.load_score != 0 or worker in self.in_flight for worker in workers)
        for worker in workers:
            if worker.load_score != 0 or worker in self.in_flight:
                continue
            if self.slots and busy >= self.slots:
                return  # no core is idle: a copy would slow the workers that are computing
            candidate = self.candidate(worker, workers)
            if candidate is not None:
                candidate.tried.add(worker)
                task = asyncio.create_task(self._copy(worker, candidate))
                self.in_flight[worker] = task
                task.add_done_callback(lambda _, at=worker: self._done(at, workers))
                busy += 1

    def candidate(self, worker: Worker, workers: list[Worker]) -> Answered | None:
        """The newest answered prompt not tried on `worker` of which it lacks at least `min_tokens`."""
        for answered in reversed(self.recent):
            if worker in answered.tried:
                continue
            held = self.policy.held_by(answered.key, workers)
            assert answered.key.tokens is not None
            if held is not None and len(answered.key.tokens) - held.get(worker, 0) >= self.min_tokens:
                return answered
            answered.tried.add(worker)  # it holds the prompt (or the policy cannot tell): never a copy there
        return None

    def _done(self, worker: Worker, workers: list[Worker]) -> None:
        self.in_flight.pop(worker, None)
        self.pump([w for w in workers if w.healthy])

    async def _copy(self, worker: Worker, answered: Answered) -> None:
        if await send_copy(self.client, worker, answered.path, answered.body, answered.headers, self.timeout_s,
                           self.metrics.idle_copies, "idle"):
            self.policy.on_copied(answered.key, worker)

    async def run(self, pool: WorkerPool) -> None:
        """Every `interval`, feed the workers that went idle since (the loop the app's lifespan runs)."""
        while True:
            await asyncio.sleep(self.interval)
            self.pump(pool.healthy())

    async def stop(self) -> None:
        for task in list(self.in_flight.values()):
            task.cancel()
        await asyncio.gather(*self.in_flight.values(), return_exceptions=True)


async def send_copy(client: httpx.AsyncClient, worker: Worker, path: str, body: bytes, headers: dict[str, str],
                    timeout_s: float, outcomes: Counter, kind: str) -> bool:
    """Send a copy (idle or the share guard's warm one) to `worker`; count its outcome by worker in
    `outcomes` (ok, the status, or failed); True when it answered 200. Nobody waits on a copy, so a transport
    error (a timeout included: the worker aborts the copy when the connection closes) is only logged: the
    health poll deals with the worker."""
    try:
        answer = await client.post(worker.url + path, content=body, headers=headers, timeout=timeout_s)
    except httpx.TransportError as err:
        logger.info("router: %s copy to %s failed: %s", kind, worker.url, err)
        outcomes.labels(worker.url, "failed").inc()
        return False
    outcomes.labels(worker.url, "ok" if answer.status_code == 200 else str(answer.status_code)).inc()
    return answer.status_code == 200
