"""The worker pool: health checks, load polling, and who is in the pool right now.

Every `interval` seconds each worker's `GET /load` is polled (running / waiting requests, KV usage,
block size, hash function, KV-event endpoint). A worker that fails `max_failures` polls in a row, or
that refuses a connection while a request is proxied to it, leaves the pool at once; when its polls
succeed again it rejoins with a new `generation`, and the policies drop whatever they had indexed for
it (its cache died with the old process).

Load as the router sees it: `in_flight + external`. `in_flight` is the router's own count of requests
it has outstanding on the worker (the proxy counts one up when it sends a request and down when the
attempt ends: answered, failed, retried elsewhere, or abandoned by its client): exact and immediate.
`external` is what the last poll saw beyond that, the traffic that did not come through this router:
the polled running + waiting less every request of ours that may have been in the worker's count
(those in flight when the poll was sent and those sent while it was out). The poll alone lags by up to
an interval (250 ms in the benchmark): `max(in_flight, running + waiting)`, the load before, still
counted requests that had finished, and SGLang's imbalance guard fired on them.

`starts` is the router's own record of prefill work queued there: for each request it sent that has
not answered its first token yet, its uncached prompt tokens (as the policy estimated them;
`prefills` lists them, `policies/eta.py` scores workers by them) and when it was sent;
`seconds_per_token` is the worker's prefill speed as this router has seen it (an EWMA of time to first
token per uncached token, long prefills only): together, how far the oldest has got.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

logger = logging.getLogger("kvserve.router")
POLL_TIMEOUT_S = 5.0
SPEED_MIN_TOKENS = 256  # prefills shorter than this time the request's overhead more than its prefill
SPEED_EWMA = 0.3  # weight of the newest observation in `seconds_per_token`


@dataclass(slots=True, eq=False)
class PrefillStart:
    """A request in flight on a worker that has not answered its first token: its uncached prompt
    tokens (the policy's estimate) and when it was sent."""

    tokens: int
    started: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class WorkerLoad:
    """One `/load` answer."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_blocks: int | None = None  # the worker's KV pool: with block_size, how many tokens it can cache
    tier_blocks: int = 0  # how many more its host RAM and disk tiers hold, loaded back instead of computed
    block_size: int | None = None
    prefix_hash: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    instance: str | None = None  # changes when the worker process restarts
    role: str = "mixed"  # `kvserve serve --role`: prefill | decode | mixed (the pd policy splits on it)
    remote_tier: str | None = None  # "ok" | "open" (breaker open: the store is unreachable) | None (no store)
    remote_store: str | None = None  # which store: workers naming the same one load each other's blocks

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerLoad:
        return cls(
            running=int(data.get("running", 0)), waiting=int(data.get("waiting", 0)),
            kv_usage=float(data.get("kv_usage", 0.0)), num_blocks=data.get("num_blocks"),
            tier_blocks=int(data.get("tier_blocks") or 0),
            block_size=data.get("block_size"),
            prefix_hash=data.get("prefix_hash"), kv_events_endpoint=data.get("kv_events_endpoint"),
            kv_events_replay_endpoint=data.get("kv_events_replay_endpoint"), instance=data.get("instance"),
            role=str(data.get("role", "mixed")), remote_tier=data.get("remote_tier"),
            remote_store=data.get("remote_store"),
        )


@dataclass(slots=True, eq=False)
class Worker:
    """A worker as the router tracks it. `generation` counts (re)joins: indexes are per generation."""

    url: str
    healthy: bool = False
    generation: int = 0
    load: WorkerLoad = field(default_factory=WorkerLoad)
    in_flight: int = 0  # requests this router has outstanding here (proxy.Upstream keeps it)
    sent: int = 0  # requests this router has ever sent here (a poll's window: see `external`)
    ours_at_poll: int = 0  # of the last poll's running + waiting, how many may have been this router's
    polled_load: bool = False  # load_score as before: max(in_flight, polled running + waiting), for comparisons
    failures: int = 0
    starts: list[PrefillStart] = field(default_factory=list)  # per request routed here, not answered yet
    seconds_per_token: float | None = None  # prefill speed seen here (None: nothing long answered yet)

    @property
    def name(self) -> str:
        return self.url

    @property
    def capacity_tokens(self) -> int | None:
        """Tokens the worker can keep at most: its KV pool and the host RAM and disk tiers below it, from which
        it loads a prompt's blocks back rather than computing them (None until its `/load` says)."""
        if self.load.num_blocks and self.load.block_size:
            return (self.load.num_blocks + self.load.tier_blocks) * self.load.block_size
        return None

    @property
    def prefills(self) -> list[int]:
        """The uncached prompt tokens (the policy's estimate) of each request in flight here that has
        not answered its first token."""
        return [start.tokens for start in self.starts]

    @property
    def pending_prefill(self) -> int:
        """Prompt tokens routed here, not cached there, whose first token has not come back."""
        return sum(start.tokens for start in self.starts)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A request with `tokens` uncached prompt tokens answered its first token after `seconds`."""
        if tokens < SPEED_MIN_TOKENS or seconds <= 0:
            return
        sample = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = sample if old is None else (1 - SPEED_EWMA) * old + SPEED_EWMA * sample

    def head_progress(self, now: float) -> float:
        """Tokens the oldest request in flight here has computed by now, if the worker ran it alone
        since it was sent (it runs first), by the speed seen here; 0 until a speed is known."""
        if not self.starts or self.seconds_per_token is None:
            return 0.0
        oldest = min(self.starts, key=lambda start: start.started)
        return min(float(oldest.tokens), (now - oldest.started) / self.seconds_per_token)

    def begin_request(self) -> None:
        """This router sent the worker a request (the proxy, as it sends)."""
        self.in_flight += 1
        self.sent += 1

    def end_request(self) -> None:
        """A request this router sent here ended (answered, failed, retried elsewhere or abandoned)."""
        if self.in_flight <= 0:
            raise RuntimeError(f"router: request count of {self.url} would go below zero")
        self.in_flight -= 1

    def polled(self, load: WorkerLoad, in_flight_at_send: int, sent_at_send: int) -> None:
        """A `/load` answer: the poll went out when this router had `in_flight_at_send` requests here and had
        sent `sent_at_send` in all. Ours in the worker's count are at most those plus the ones sent since."""
        self.ours_at_poll = in_flight_at_send + (self.sent - sent_at_send)
        self.load = load

    @property
    def external(self) -> int:
        """Running + waiting at the last poll beyond this router's own requests: traffic from elsewhere."""
        return max(self.load.running + self.load.waiting - self.ours_at_poll, 0)

    @property
    def load_score(self) -> int:
        """Requests on the worker: this router's own (exact) and others' (as of the last poll)."""
        if self.polled_load:
            return max(self.in_flight, self.load.running + self.load.waiting)
        return self.in_flight + self.external


JoinCallback = Callable[[Worker], None]


class WorkerPool:
    """The workers, their health and load; `on_join` / `on_leave` tell the policies."""

    def __init__(
        self, urls: list[str], client: httpx.AsyncClient, interval: float = 1.0, max_failures: int = 2,
        poll_headers: dict[str, str] | None = None, polled_load: bool = False,
    ) -> None:
        if not urls:
            raise ValueError("the router needs at least one --worker URL")
        if len(set(urls)) != len(urls):
            raise ValueError("duplicate --worker URL")
        self.workers = [Worker(url=url.rstrip("/"), polled_load=polled_load) for url in urls]
        self._client = client
        self._interval = interval
        self._max_failures = max_failures
        self._poll_headers = poll_headers or {}
        self.on_join: list[JoinCallback] = []
        self.on_leave: list[JoinCallback] = []

    def healthy(self) -> list[Worker]:
        return [worker for worker in self.workers if worker.healthy]

    async def run(self) -> None:
        """Poll forever (cancel to stop)."""
        while True:
            await self.poll_all()
            await asyncio.sleep(self._interval)

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(worker) for worker in self.workers))

    async def _poll(self, worker: Worker) -> None:
        in_flight, sent = worker.in_flight, worker.sent
        try:
            load = await self._fetch_load(worker)
        except (httpx.HTTPError, ValueError) as err:
            worker.failures += 1
            if worker.healthy and worker.failures >= self._max_failures:
                self.mark_down(worker, f"{type(err).__name__}: {err}")
            return
        worker.failures = 0
        restarted = worker.healthy and load.instance is not None and load.instance != worker.load.instance
        if restarted:  # came back between two polls: same URL, new process, empty cache
            self.mark_down(worker, "restarted")
        worker.polled(load, in_flight, sent)
        if not worker.healthy:
            self._join(worker)

    async def _fetch_load(self, worker: Worker) -> WorkerLoad:
        timeout = max(2 * self._interval, POLL_TIMEOUT_S)  # a busy worker answers late, not never
        response = await self._client.get(f"{worker.url}/load", headers=self._poll_headers, timeout=timeout)
        if response.status_code in (401, 403, 404):  # no admin key, or an older worker: health only
            response = await self._client.get(f"{worker.url}/health", timeout=timeout)
            if response.status_code == 200:
                return WorkerLoad()
        if response.status_code != 200:
            raise ValueError(f"{response.request.url.path} answered {response.status_code}")
        return WorkerLoad.from_json(response.json())

    def _join(self, worker: Worker) -> None:
        worker.healthy = True
        worker.generation += 1
        logger.info("router: worker %s joined (generation %d)", worker.url, worker.generation)
        for callback in self.on_join:
            callback(worker)

    def mark_down(self, worker: Worker, reason: str) -> None:
        """Take `worker` out of the pool now (a failed poll or a refused proxy connection)."""
        if not worker.healthy:
            return
        worker.healthy = False
        logger.warning("router: worker %s left the pool: %s", worker.url, reason)
        for callback in self.on_leave:
            callback(worker)
