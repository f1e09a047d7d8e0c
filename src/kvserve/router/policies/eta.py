"""A worker's estimated time to first token for a request, in tokens of prefill: the load term of the
cache-aware policies.

    eta(worker) = uncached prompt tokens there (u)
                + load_weight × (Σ over its pending prefills p of min(p, u) + overhead × requests there)

The pending prefills are the uncached prompt tokens of each request this router sent the worker that
has not answered its first token yet (`Worker.prefills`, kept by the proxy): exact and immediate,
where a polled count is a poll late and counts every request alike, though three chat turns of 240
new tokens each and three first reads of a 1,024-token document are different waits. A worker shares
each step among the prefills it runs (chunked prefill, newcomers first: `engine/scheduler.py`), so a
request of u new tokens is delayed by about u tokens of each longer prefill running beside it, not by
all of it (processor sharing: a 48-token question beside a 1,024-token first read waits ~48 tokens).
`request_overhead` prices what each request in flight costs besides its prefill (its scheduling and
decode rows, which share the steps too). This is Dynamo's KV router cost (`overlap_weight × prefill
blocks + decode blocks`, the lowest wins) in tokens, with the request's own prefill and the work
beside it weighed apart:

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

    def queued(self, worker: Worker, uncached: int) -> float:
        """The work that delays a new request of `uncached` tokens on `worker`, in tokens of prefill."""
        shared = sum(min(pending, uncached) for pending in worker.prefills)
        return shared + self.request_overhead * worker.in_flight

    def eta(self, worker: Worker, uncached: int) -> float:
        """The request's estimate on `worker`, where `uncached` of its tokens are not cached."""
        return uncached + self.load_weight * self.queued(worker, uncached)

    def costs(self, prompt_tokens: int, matches: dict[Worker, int]) -> dict[Worker, float]:
        """Each worker's estimate; `matches`: the prompt tokens each one holds."""
        return {worker: self.eta(worker, max(prompt_tokens - held, 0)) for worker, held in matches.items()}

    @staticmethod
    def cheapest(costs: dict[Worker, float]) -> list[Worker]:
        """The workers of least estimate (the caller breaks ties by load)."""
        least = min(costs.values())
        return [worker for worker, cost in costs.items() if cost == least]
