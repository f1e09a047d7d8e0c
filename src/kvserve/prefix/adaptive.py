"""`alru`: glru whose protection of proven blocks is learned online from ghost hits (ARC's adaptation).

glru ranks a unit used by two requests or more (*proven*) `protect` seconds younger than its last use,
and a unit used once `probation` seconds older; the right `protect` depends on the workload (longer
gains on Mooncake's minutes-apart conversation turns, shorter on a chat whose conversations end). ARC
answers this with its ghost lists: a miss on a block recently evicted from the recency list says that
list should grow, a miss on one evicted from the frequency list says the frequency list should. Here a
ghost remembers which class its run was evicted from, and a request that recomputes that run moves
`protect`: up (geometrically) when a proven run came back, down when a once-used one did, each step
scaled by the other class's share of recent ghost hits as ARC scales its steps by the ghost lists'
sizes. The ghost re-registers the run proven either way, as in glru.

Since `protect` moves without any unit being used, the two classes sit in two heaps keyed by last use
(a proven unit's key carries a PROVEN offset so that a unit changing class gets a new heap entry), and
eviction compares the two heads with the current offsets: exact at every `protect`, as ARC's lists are.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

from kvserve.prefix.eviction import EvictionPolicy, Unit, live_head

PROVEN = 1e12  # key offset of a proven unit (the cache's clock never gets near it)


class AdaptiveGhostLRUPolicy(EvictionPolicy):
    """glru with `protect` in [low, high] seconds, adapted by which class the recomputed runs were
    evicted from."""

    name = "alru"

    def __init__(self, protect: float = 30.0, probation: float = 20.0, low: float = 1.0,
                 high: float = 1800.0, rate: float = 0.05) -> None:
        super().__init__()
        self.protect, self.probation, self.low, self.high, self.rate = protect, probation, low, high, rate
        self.ghosts: OrderedDict[bytes, tuple[int, bool]] = OrderedDict()  # head -> (uses, was proven)
        self.ghost_limit = 1024
        self.returns = [1.0, 1.0]  # decayed ghost hits: [once-used, proven]
        self._heaps: tuple[list[tuple[float, int, Unit]], list[tuple[float, int, Unit]]] = ([], [])

    def attach(self, num_blocks: int) -> None:
        self.ghost_limit = max(self.ghost_limit, num_blocks)

    def value(self, unit: Unit) -> float:
        return unit.last_access + (PROVEN if unit.hits >= 2 else 0.0)

    def _push(self, unit: Unit) -> None:
        unit.heap_stamp = unit.priority
        heapq.heappush(self._heaps[unit.priority >= PROVEN], (unit.priority, next(self._tiebreak), unit))

    def _head(self, heap: list[tuple[float, int, Unit]]) -> tuple[float, int, Unit] | None:
        return live_head(heap, self._push)

    def pop(self) -> Unit | None:
        once, proven = self._head(self._heaps[0]), self._head(self._heaps[1])
        if once is None and proven is None:
            return None
        take_once = proven is None or (
            once is not None and once[0] - self.probation <= proven[0] - PROVEN + self.protect)
        heap = self._heaps[0] if take_once else self._heaps[1]
        unit = heapq.heappop(heap)[2]
        unit.heap_stamp = None
        return unit

    def queued(self) -> set[int]:
        return {id(unit) for heap in self._heaps for stamp, _, unit in heap if unit.heap_stamp == stamp}

    def inserted(self, unit: Unit, now: float) -> None:
        hits, proven = self.ghosts.pop(unit.head_hash, (0, False))
        if hits:
            self._adapt(proven)
        unit.hits, unit.last_access = 1 + hits, now
        self._revalue(unit)

    def _adapt(self, proven: bool) -> None:
        returns = self.returns
        returns[0] *= 0.999
        returns[1] *= 0.999
        returns[proven] += 1.0
        step = self.rate * min(8.0, max(1.0, returns[not proven] / returns[proven]))
        factor = math.exp(step if proven else -step)
        self.protect = min(self.high, max(self.low, self.protect * factor))

    def evicted(self, unit: Unit, run_head: bytes) -> None:
        ghosts = self.ghosts
        ghosts.pop(run_head, None)
        ghosts[run_head] = (unit.hits, unit.hits >= 2)
        if len(ghosts) > self.ghost_limit:
            ghosts.popitem(last=False)

    def clear(self) -> None:
        super().clear()
        self._heaps[0].clear()
        self._heaps[1].clear()
        self.ghosts.clear()
        self.returns = [1.0, 1.0]
