"""A worker's estimated time to first token for a request, in tokens of prefill: the load term of the
cache-aware policies.

    eta(worker) = uncached prompt tokens there
                + load_weight × (pending prefill there + request_overhead × requests in flight there)

`pending prefill` is the uncached prompt tokens of the requests this router sent the worker that have
not answered their first token yet (`Worker.pending_prefill`, kept by the proxy): exact and immediate,
where a polled count is a poll late and counts every request alike, though three chat turns of 240
new tokens each and three first reads of a 1,024-token document are very different waits.
`request_overhead` prices what every request in flight costs besides its prefill (its scheduling and
decode steps, which share the worker's batch with the new request's prefill). This is Dynamo's KV
router cost (`overlap_weight × prefill blocks + decode blocks`, the lowest wins) in tokens, with the
request's own prefill and the work queued ahead of it weighed apart:

`load_weight` below 1 charges a copy for the work it adds, not only for the wait it causes this
request: a prefix computed again on a second worker delays every later request there too, while the
copy's benefit to this one request is the queue it skips. At 1 a request leaves a busy holder of its
prefix as soon as computing the prefix elsewhere is quicker for it alone; at the default (2/3) when
the queue it skips is 1.5 × the extra prefill.

Requests that reached a worker some other way (another router) are not in these counts: each router
scores by its own traffic, as Dynamo's routers do without their replica sync.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.router.config import LOAD_WEIGHT, REQUEST_OVERHEAD
from kvserve.router.workers import Worker


@dataclass(frozen=True, slots=True)
class EtaCost:
    load_weight: float = LOAD_WEIGHT
    request_overhead: float = REQUEST_OVERHEAD

    def __post_init__(self) -> None:
        if self.load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {self.load_weight}")
        if self.request_overhead < 0:
            raise ValueError(f"request_overhead must be >= 0, got {self.request_overhead}")

    def queued(self, worker: Worker) -> float:
        """The work ahead of a new request on `worker`, in tokens of prefill."""
        return worker.pending_prefill + self.request_overhead * worker.in_flight

    def eta(self, worker: Worker, uncached: int) -> float:
        """The request's estimate on `worker`, where `uncached` of its tokens are not cached."""
        return uncached + self.load_weight * self.queued(worker)

    def costs(self, prompt_tokens: int, matches: dict[Worker, int]) -> dict[Worker, float]:
        """Each worker's estimate; `matches`: the prompt tokens each one holds."""
        return {worker: self.eta(worker, max(prompt_tokens - held, 0)) for worker, held in matches.items()}

    @staticmethod
    def cheapest(costs: dict[Worker, float]) -> list[Worker]:
        """The workers of least estimate (the caller breaks ties by load)."""
        least = min(costs.values())
        return [worker for worker, cost in costs.items() if cost == least]
