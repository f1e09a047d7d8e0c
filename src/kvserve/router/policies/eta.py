"""A worker's estimated time to first token for a request, in tokens of prefill: the load term of the
cache-aware policies.

    eta(worker) = uncached prompt tokens there (u)
                + load_weight × (prefill queued there + overhead × requests there)

The queued prefill is the uncached prompt tokens of each request this router sent the worker that has
not answered its first token yet (`Worker.prefills`, kept by the proxy): exact and immediate, where a
polled count is a poll late and counts every request alike, though three chat turns of 240 new tokens
each and three first reads of a 1,024-token document are different waits. A new request waits for all
of it (`queue_model="fcfs"`, the default), less what the oldest of them has computed by now at the
speed this router has seen there (`Worker.seconds_per_token`, learned from the worker's own answers):
measured on one 1-thread worker, a 48-token question (its prefix cached) answered in 0.13 s alone and
in 2.2 s when sent 0.1 s after an unrelated 1,072-token first read, which took 2.2 s itself
(`benchmarks/router.py` tails; the worker runs the read's steps first). The estimate before it
(`queue_model="shared"`: Σ min(p, u), processor sharing, a question beside a read waiting only ~u
tokens of it) kept questions queued behind first reads on one worker while the other idled: RAG over
2 workers, p90 0.6× round_robin's. A request whose prefix another request there is still computing
waits for it too (the worker holds it until those blocks are published, `engine/prefix_admission.py`);
that is in the queue already.
`request_overhead` prices what each request in flight costs besides its prefill (its scheduling and
decode rows). This is Dynamo's KV router cost (`overlap_weight × prefill blocks + decode blocks`, the
lowest wins) in tokens, with the request's own prefill and the work ahead of it weighed apart:

`load_weight` below 1 charges a copy for the work it adds, not only for the wait it causes this
request: a prefix computed again on a second worker delays every later request there too, while the
copy's benefit to this one request is the queue it skips. At 1 a request leaves a busy holder of its
prefix as soon as computing the prefix elsewhere is quicker for it alone; at the default (2/3) when
the queue it skips is 1.5 × the extra prefill.

Requests that reached a worker some other way (another router) are not in these counts: each router
scores by its own traffic, as Dynamo's routers do without their replica sync.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvserve.router.config import LOAD_WEIGHT, QUEUE_MODELS, REQUEST_OVERHEAD
from kvserve.router.workers import Worker


@dataclass(frozen=True, slots=True)
class EtaCost:
    load_weight: float = LOAD_WEIGHT
    request_overhead: float = REQUEST_OVERHEAD
    queue_model: str = "fcfs"  # "shared": the earlier processor-sharing estimate (for comparisons)

    def __post_init__(self) -> None:
        if self.load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {self.load_weight}")
        if self.request_overhead < 0:
            raise ValueError(f"request_overhead must be >= 0, got {self.request_overhead}")
        if self.queue_model not in QUEUE_MODELS:
            raise ValueError(f"queue_model must be one of {QUEUE_MODELS}, got {self.queue_model!r}")

    def queued(self, worker: Worker, uncached: int, now: float | None = None) -> float:
        """The work that delays a new request of `uncached` tokens on `worker`, in tokens of prefill."""
        if self.queue_model == "shared":
            ahead = float(sum(min(pending, uncached) for pending in worker.prefills))
        else:
            ahead = max(sum(worker.prefills) - worker.head_progress(time.monotonic() if now is None else now), 0.0)
        return ahead + self.request_overhead * worker.in_flight

    def eta(self, worker: Worker, uncached: int, now: float | None = None) -> float:
        """The request's estimate on `worker`, where `uncached` of its tokens are not cached."""
        return uncached + self.load_weight * self.queued(worker, uncached, now)

    def costs(self, prompt_tokens: int, matches: dict[Worker, int]) -> dict[Worker, float]:
        """Each worker's estimate; `matches`: the prompt tokens each one holds."""
        now = time.monotonic()
        return {worker: self.eta(worker, max(prompt_tokens - held, 0), now) for worker, held in matches.items()}

    @staticmethod
    def cheapest(costs: dict[Worker, float]) -> list[Worker]:
        """The workers of least estimate (the caller breaks ties by load)."""
        least = min(costs.values())
        return [worker for worker, cost in costs.items() if cost == least]

