"""The policy interface and the load comparison every policy falls back to."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvserve.router.keys import RouteKey
from kvserve.router.workers import Worker


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes; `reason` labels the decision metric; `matched_tokens` what the policy
    believes is cached there for this prompt."""

    worker: Worker
    reason: str
    matched_tokens: int = 0


class Policy:
    """Pick one of `workers` (non-empty, all healthy). Index hooks default to doing nothing."""

    name = "policy"

    def choose(self, key: RouteKey, workers: list[Worker]) -> Decision:
        raise NotImplementedError

    def on_routed(self, key: RouteKey, worker: Worker) -> None:
        """The request keyed `key` was sent to `worker` (the proxy calls this once it commits)."""

    def on_join(self, worker: Worker) -> None:
        """`worker` (re)joined the pool: whatever was indexed for it is stale."""

    def on_leave(self, worker: Worker) -> None:
        """`worker` left the pool."""

    async def start(self) -> None:
        """Start background work (event subscriptions)."""

    async def stop(self) -> None:
        """Stop background work."""


class LoadTieBreaker:
    """The least loaded worker; ties rotate, so equal workers share the traffic evenly."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def least_loaded(self, workers: list[Worker]) -> Worker:
        best = min(_load_key(worker) for worker in workers)
        tied = [worker for worker in workers if _load_key(worker) == best]
        return tied[next(self._turn) % len(tied)]


def _load_key(worker: Worker) -> tuple[int, float]:
    return worker.load_score, round(worker.load.kv_usage, 2)


def is_imbalanced(workers: list[Worker], abs_threshold: int, rel_threshold: float) -> bool:
    """SGLang's test: max − min load above `abs_threshold` and max above `rel_threshold` × min."""
    loads = [worker.load_score for worker in workers]
    high, low = max(loads), min(loads)
    return high - low > abs_threshold and high > rel_threshold * low

