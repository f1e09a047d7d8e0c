"""Diagnostic oracle policies (replay only): how far an online policy that learns one thing can get.

Belady knows *when* every block is used next. These know less, and so bound what an online policy that
learns only that much could reach:
- `oracle-reuse`: knows whether a block will be used again at all (not when); blocks that never will are
  evicted first, LRU within each class. A policy that learned reuse/no-reuse perfectly (from insertion
  features, ghosts, anything) is this one.
- `oracle-hN`: knows whether a block's next use comes within N seconds of now; the others go first, LRU
  within each class. `oracle-reuse` is the infinite horizon.

They are oracles, never policies: they need the trace's future, so they are built by the replay driver
and are not among `make_policy`'s names (the engine cannot select them). A block's class can only
improve as time passes (a use beyond the horizon comes within it), so the heap holds lower bounds and a
popped unit is valued again before it goes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from kvserve.prefix.eviction import EvictionPolicy, Unit

ORACLE_POLICIES = ("oracle-reuse", "oracle-h60", "oracle-h300", "oracle-h1800")
KEEP = 1e12  # added to a kept unit's recency: any kept unit outranks every unit not kept

NextUseTime = Callable[[bytes], float]  # block hash -> time of its next use (inf: never)


class HorizonOracle(EvictionPolicy):
    """LRU in two classes: blocks next used within `horizon` seconds of now are kept over the rest."""

    def __init__(self, name: str, horizon: float, next_use_time: NextUseTime, clock: Callable[[], float]) -> None:
        super().__init__()
        self.name, self.horizon = name, horizon
        self.next_use_time, self.clock = next_use_time, clock

    def _kept(self, block_hash: bytes) -> bool:
        when = self.next_use_time(block_hash)
        return when != math.inf and when - self.clock() <= self.horizon

    def value(self, unit: Unit) -> float:
        return unit.last_access + (KEEP if self._kept(unit.tail_hash) else 0.0)

    def pop(self) -> Unit | None:
        while True:
            unit = super().pop()
            if unit is None:
                return None
            fresh = self.value(unit)
            if fresh <= unit.priority:
                return unit
            unit.priority = fresh  # came within the horizon while queued
            self._push(unit)

    def take(self, hashes: Sequence[bytes], need: int) -> int:
        """Only the tail blocks in the tail's class (a head kept for a nearer use stays)."""
        kept, k = self._kept(hashes[-1]), 1
        while k < min(need, len(hashes)) and self._kept(hashes[-1 - k]) == kept:
            k += 1
        return min(need, k)


def make_oracle(name: str, next_use_time: NextUseTime, clock: Callable[[], float]) -> HorizonOracle:
    """The oracle named `name` (see ORACLE_POLICIES); ValueError otherwise."""
    if name == "oracle-reuse":
        return HorizonOracle(name, math.inf, next_use_time, clock)
    if name in ORACLE_POLICIES:
        return HorizonOracle(name, float(name.removeprefix("oracle-h")), next_use_time, clock)
    raise ValueError(f"unknown oracle {name!r}; expected one of {', '.join(ORACLE_POLICIES)}")
