"""`predict`: evict the leaf least likely to be used again before it would be evicted anyway.

Belady evicts the leaf whose next use is farthest; LRB (Song et al., NSDI'20) relaxes that to "any leaf
whose next use lies beyond the Belady boundary" and learns, online, to predict it. This is the cheap
version of that idea, with the learner written out: the features are the ones the cache's units carry
(uses so far, the last gap between two uses), the model is a survival curve of the time to the next use
per feature class, learned from the cache's own history with labels revealed late, and the boundary is
the age at which units are being evicted now.

- **Classes.** A unit used once is class 0; one used `n` >= 2 times (ghost uses included, as in glru) is
  classed by min(n, 4) and the bucket of its last gap between uses (< 10 s, 30, 90, 270, 810, more).
- **Labels.** A use of a unit is an event for the class it had, at the gap since its previous use; an
  eviction is a censored observation (not used for at least its age), left in a ghost (the evicted run's
  head hash, as in glru) whose censoring follows the clock until a request recomputes the run (any run
  of a chain evicted piece by piece: every block hash of a new unit is looked up), which turns it into
  an event at the true gap: LRB's delayed labels, kept in the ghost list rather than a sliding window.
  Observations count blocks (a split-off dead tail must not outweigh the run that was used) and age by
  weighting each new one more (half-life `half_life` observations).
- **Model.** Per class, a Kaplan-Meier survival curve S(t) on half-octave buckets of time (1 s to 9 h),
  each bucket's hazard shrunk toward the pooled hazard of all classes when the class has few samples.
- **Score.** A candidate idle for `a` seconds is used within the next H seconds with probability
  1 - S(a + H) / S(a); H is `horizon` (5) times the running mean age of evicted units (the cache's own
  characteristic time; 1x-12x measured, 5x best on Mooncake). Least likely goes first.
- **Cost.** Each class keeps its candidates in a heap by last use and eviction compares the classes'
  oldest units only: a pop is one heap pop plus ~19 two-point look-ups, and the curves are rebuilt every
  `refit` observations. That is exact when a class's score falls with age; here it rises for the first
  minute (a chat's next turn), and sampling 32 candidates instead (LRB's eviction) was measured: +0.1
  point at 5% of Mooncake, -0.5 at 40% (random samples of a large cache miss its oldest units).

What it cannot learn: which unit used once will come back. On the Mooncake trace 84% of inserted blocks
are a prompt's first use and nothing the cache sees tells the quarter that return from the rest
(benchmarks/eviction_features.py), so the learned gain is in ranking the proven units against the
unproven ones by their age, which alru does with one adaptive offset.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.prefix.eviction import EvictionPolicy, Unit, live_head

GAP_EDGES = (10.0, 30.0, 90.0, 270.0, 810.0)  # s: buckets of a unit's last gap between uses
MAX_USES = 4  # uses are classed 1, 2, 3, 4+
NUM_CLASSES = 1 + (MAX_USES - 1) * (len(GAP_EDGES) + 1)
NUM_BUCKETS = 30  # half-octaves of time since use: 1 s .. 2^15 s
CLASS_OFFSET = 1e12  # heap key offset per class (the cache's clock never gets near it)
PRIOR = 4.0  # pseudo-observations of the pooled hazard in each class bucket


def time_position(seconds: float) -> float:
    """Continuous bucket position of a duration (half-octaves of 1 + seconds), clipped to the grid."""
    return min(2.0 * math.log2(1.0 + max(seconds, 0.0)), NUM_BUCKETS - 1e-9)


def unit_class(hits: int, gap: float) -> int:
    """0 for a unit used once; else one class per (uses up to MAX_USES, last-gap bucket)."""
    if hits <= 1:
        return 0
    return 1 + (min(hits, MAX_USES) - 2) * (len(GAP_EDGES) + 1) + bisect.bisect_right(GAP_EDGES, gap)


def class_of(unit: Unit) -> int:
    return unit_class(unit.hits, unit.gap)


class SurvivalModel:
    """Per-class Kaplan-Meier curves of the time to a unit's next use, from events and censorings."""

    def __init__(self, half_life: int) -> None:
        self.events = [[0.0] * NUM_BUCKETS for _ in range(NUM_CLASSES)]
        self.censored = [[0.0] * NUM_BUCKETS for _ in range(NUM_CLASSES)]
        self.weight, self.growth = 1.0, 2.0 ** (1.0 / half_life)
        self.log_scale = 0.0  # log of all rescalings so far: a weight w given out is exp(log w + log_scale)
        self.curves = [[1.0] * (NUM_BUCKETS + 1) for _ in range(NUM_CLASSES)]
        self.mean_blocks = 1.0  # running mean blocks per observation (sizes the prior)

    def observe(self, cls: int, seconds: float, used: bool, blocks: int = 1) -> float:
        """One observation of `blocks` blocks; returns its log weight (to take a censoring back later)."""
        self.mean_blocks += 0.01 * (blocks - self.mean_blocks)
        self.weight *= self.growth
        if self.weight > 1e12:  # rescale before floats lose the small counts
            for table in (*self.events, *self.censored):
                table[:] = [count / self.weight for count in table]
            self.log_scale += math.log(self.weight)
            self.weight = 1.0
        (self.events if used else self.censored)[cls][int(time_position(seconds))] += self.weight * blocks
        return math.log(self.weight * blocks) + self.log_scale

    def move_censoring(self, cls: int, bucket: int, log_weight: float, to: int | None) -> None:
        """Move a censored observation from `bucket` to bucket `to` (None: take it back)."""
        weight = math.exp(log_weight - self.log_scale)
        row = self.censored[cls]
        row[bucket] = max(0.0, row[bucket] - weight)
        if to is not None:
            row[to] += weight

    def refit(self) -> None:
        pooled = self._hazards([sum(col) for col in zip(*self.events, strict=True)],
                               [sum(col) for col in zip(*self.censored, strict=True)], None)
        strength = PRIOR * self.mean_blocks * self.weight  # PRIOR observations of today's weight
        for cls in range(NUM_CLASSES):
            hazards = self._hazards(self.events[cls], self.censored[cls], pooled, strength)
            curve, alive = [1.0], 1.0
            for hazard in hazards:
                alive *= 1.0 - hazard
                curve.append(alive)
            self.curves[cls] = curve

    @staticmethod
    def _hazards(events: list[float], censored: list[float], prior: list[float] | None,
                 strength: float = 0.0) -> list[float]:
        at_risk, hazards = sum(events) + sum(censored), []
        for used, lost in zip(events, censored, strict=True):
            if prior is None:
                hazards.append(used / at_risk if at_risk > 0 else 0.0)
            else:
                hazards.append((used + strength * prior[len(hazards)]) / (at_risk + strength))
            at_risk -= used + lost
        return hazards

    def survival(self, cls: int, seconds: float) -> float:
        """S(seconds) for the class, linear between bucket edges."""
        position = time_position(seconds)
        low = int(position)
        curve = self.curves[cls]
        return curve[low] + (curve[low + 1] - curve[low]) * (position - low)

    def use_within(self, cls: int, age: float, horizon: float) -> float:
        """P(used within `horizon` more seconds | unused for `age` seconds). (`survival` twice, inlined:
        eviction calls this once per class.)"""
        curve, log2, top = self.curves[cls], math.log2, NUM_BUCKETS - 1e-9
        age = age if age > 0.0 else 0.0
        position = min(2.0 * log2(1.0 + age), top)
        low = int(position)
        alive = curve[low] + (curve[low + 1] - curve[low]) * (position - low)
        if alive <= 1e-12:
            return 0.0
        position = min(2.0 * log2(1.0 + age + horizon), top)
        low = int(position)
        return 1.0 - (curve[low] + (curve[low + 1] - curve[low]) * (position - low)) / alive


@dataclass(slots=True, eq=False)
class Ghost:
    """An evicted run, censored (not used again for at least its age) until it is used or forgotten."""

    hits: int
    last_use: float
    cls: int
    blocks: int  # how many blocks the eviction took
    bucket: int  # the age bucket its censoring sits in
    log_weight: float
    open: bool = True


class NextUsePolicy(EvictionPolicy):
    """Least likely to be used within the cache's characteristic time goes first (see module docstring)."""

    name = "predict"

    def __init__(self, horizon: float = 5.0, half_life: int = 20_000, refit: int = 256) -> None:
        super().__init__()
        self.horizon, self.refit_every = horizon, refit
        self.model = SurvivalModel(half_life)
        self.eviction_age = 30.0  # running mean age (s since last use) of evicted units
        self.now = 0.0  # latest time an event carried (evictions carry none)
        self.ghosts: OrderedDict[bytes, Ghost] = OrderedDict()  # evicted run's head -> record
        self.ghost_limit = 1024
        self._crossings: list[tuple[float, int, Ghost]] = []  # (when a ghost's age enters its next bucket, ...)
        self._since_refit = 0
        self._taken = 1
        self._heaps: list[list[tuple[float, int, Unit]]] = [[] for _ in range(NUM_CLASSES)]

    def attach(self, num_blocks: int) -> None:
        self.ghost_limit = max(self.ghost_limit, num_blocks)

    def value(self, unit: Unit) -> float:
        return class_of(unit) * CLASS_OFFSET + unit.last_access

    # ---- events ----------------------------------------------------------------------------------

    def inserted(self, unit: Unit, now: float) -> None:
        self.now = max(self.now, now)
        uses, gap, ghosts = 1, math.inf, self.ghosts
        for block_hash in unit.hashes:  # runs evicted earlier and computed again: censorings become events
            ghost = ghosts.pop(block_hash, None) if ghosts else None
            if ghost is None:
                continue
            self._settle(ghost, None)
            self._observe(ghost.cls, now - ghost.last_use, True, ghost.blocks)
            if block_hash == unit.head_hash:  # the unit inherits its first run's history (glru's ghost)
                gap, uses = now - ghost.last_use, 1 + ghost.hits
        unit.hits, unit.gap, unit.last_access, unit.hit_time = uses, gap, now, now
        self._revalue(unit)

    def touch(self, unit: Unit, now: float) -> None:
        self.now = max(self.now, now)
        super().touch(unit, now)

    def hit(self, unit: Unit) -> None:
        """A use: label the unit's previous class with the gap (its lookup just set last_access)."""
        gap = unit.last_access - unit.hit_time
        self._observe(class_of(unit), gap, True, unit.num_blocks)
        unit.hits += 1
        unit.gap, unit.hit_time = gap, unit.last_access
        self._revalue(unit)

    def evicted(self, unit: Unit, run_head: bytes) -> None:
        self.eviction_age += 0.01 * (max(0.0, self.now - unit.last_access) - self.eviction_age)
        cls, age = class_of(unit), max(0.0, self.now - unit.hit_time)
        blocks = unit.num_blocks if run_head == unit.head_hash else self._taken
        ghost = Ghost(unit.hits, unit.hit_time, cls, blocks, int(time_position(age)),
                      self.model.observe(cls, age, False, blocks))
        self._schedule(ghost)
        ghosts = self.ghosts
        old = ghosts.pop(run_head, None)
        if old is not None:
            old.open = False  # its run was cached and evicted again: the old record stays censored as is
        ghosts[run_head] = ghost
        if len(ghosts) > self.ghost_limit:
            ghosts.popitem(last=False)[1].open = False  # forgotten: censored at its last age

    def take(self, hashes: Sequence[bytes], need: int) -> int:
        self._taken = min(need, len(hashes))  # a trimmed unit's censoring counts the blocks that went
        return need

    # ---- delayed labels: a ghost's censoring age follows the clock until it is used or forgotten -------

    def _schedule(self, ghost: Ghost) -> None:
        if ghost.bucket + 1 < NUM_BUCKETS:
            crossing = ghost.last_use + 2.0 ** ((ghost.bucket + 1) / 2.0) - 1.0
            heapq.heappush(self._crossings, (crossing, next(self._tiebreak), ghost))

    def _advance(self) -> None:
        """Move every open ghost's censoring to the bucket of its current age."""
        crossings, now = self._crossings, self.now
        if len(crossings) > 2 * self.ghost_limit:  # closed ghosts' entries: drop them (each open one has one)
            crossings[:] = [entry for entry in crossings if entry[2].open]
            heapq.heapify(crossings)
        while crossings and crossings[0][0] <= now:
            ghost = heapq.heappop(crossings)[2]
            if ghost.open:  # straight to the bucket of its age now, however many it crossed since
                self._settle(ghost, max(ghost.bucket + 1, int(time_position(now - ghost.last_use))))
                self._schedule(ghost)

    def _settle(self, ghost: Ghost, to: int | None) -> None:
        self.model.move_censoring(ghost.cls, ghost.bucket, ghost.log_weight, to)
        if to is None:
            ghost.open = False
        else:
            ghost.bucket = to

    def _observe(self, cls: int, seconds: float, used: bool, blocks: int) -> float:
        weight = self.model.observe(cls, seconds, used, blocks)
        self._since_refit += 1
        if self._since_refit >= self.refit_every:
            self._advance()
            self.model.refit()
            self._since_refit = 0
        return weight

    # ---- candidates: one heap per class, compared at their oldest units -----------------------------

    def _push(self, unit: Unit) -> None:
        unit.heap_stamp = unit.priority
        heapq.heappush(self._heaps[int(unit.priority // CLASS_OFFSET)], (unit.priority, next(self._tiebreak), unit))

    def _head(self, heap: list[tuple[float, int, Unit]]) -> tuple[float, int, Unit] | None:
        return live_head(heap, self._push)

    def pop(self) -> Unit | None:
        horizon, now, model = self.horizon * self.eviction_age, self.now, self.model
        best, best_score, best_age = -1, math.inf, 0.0
        use_within = model.use_within
        for cls, heap in enumerate(self._heaps):
            head = self._head(heap) if heap else None
            if head is None:
                continue
            age = now - (head[0] - cls * CLASS_OFFSET)
            score = use_within(cls, age, horizon)
            if score < best_score or (score == best_score and age > best_age):
                best, best_score, best_age = cls, score, age
        if best < 0:
            return None
        unit = heapq.heappop(self._heaps[best])[2]
        unit.heap_stamp = None
        return unit

    def queued(self) -> set[int]:
        return {id(unit) for heap in self._heaps for stamp, _, unit in heap if unit.heap_stamp == stamp}

    def clear(self) -> None:
        super().clear()
        for heap in self._heaps:
            heap.clear()
        self.ghosts.clear()
        self._crossings.clear()
