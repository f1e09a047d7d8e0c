"""least_load: the worker with the fewest requests (the router's own in flight there, plus polled traffic from
elsewhere: `Worker.load_score`), then the lowest KV usage."""

from __future__ import annotations

from kvserve.router.keys import RouteKey
from kvserve.router.policies.base import Decision, LoadTieBreaker, Policy
from kvserve.router.workers import Worker


class LeastLoadPolicy(Policy):
    name = "least_load"

    def __init__(self) -> None:
        self._ties = LoadTieBreaker()

    def choose(self, key: RouteKey, workers: list[Worker]) -> Decision:
        return Decision(self._ties.least_loaded(workers), "least_load")
