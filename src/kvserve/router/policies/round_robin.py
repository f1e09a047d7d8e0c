"""round_robin: each healthy worker in turn; blind to load and caches (the baseline)."""

from __future__ import annotations

import itertools

from kvserve.router.keys import RouteKey
from kvserve.router.policies.base import Decision, Policy
from kvserve.router.workers import Worker


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, key: RouteKey, workers: list[Worker]) -> Decision:
        return Decision(workers[next(self._turn) % len(workers)], "turn")
