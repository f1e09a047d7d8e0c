"""Eviction policies: which evictable leaf a prefix cache drops first (`--eviction`).

Both caches evict *leaf-first*: a unit (a radix node, a hash-cache block) is a candidate only while it is
registered, unreferenced and has no cached children, so a prefix always outlives what is built on it
and a cached block's whole prefix is always cached. Which candidate goes first is the policy's choice,
and every policy here is a *value*: the candidate with the smallest value goes first.

Candidates sit in one heap with lazy invalidation. A unit remembers the value of its live heap entry
(`heap_stamp`); a popped entry whose stamp is not the unit's live stamp is a stale duplicate and is
dropped; a live entry whose unit has since gained value (touched) is pushed again with the new value.
When a unit loses value while queued (a Belady tail trimmed) a new live entry is pushed. So eviction
never scans the cache, and the cache only reports events: a unit was registered (`inserted`), looked up
(`touch`), taken by a request (`hit`), split or trimmed (`reshaped`), became a candidate (`push`).

The policies (measured on a production trace in benchmarks/results/eviction.md):
- lru: last use. The seed's policy.
- lfu: frequency with dynamic aging (LFU-DA): `L + hits`, where L is the value of the last victim,
  so old popularity decays instead of pinning blocks forever.
- gdsf: GreedyDual-Size-Frequency: `L + hits * cost / size`, cost the prefill work a hit saves. A block
  at depth d costs about (1 + d / DEPTH_SCALE) to recompute (attention reads the whole prefix); the
  unit's cost per block is that at its tail.
- s2lru: LRU with a probation segment (the 2Q / SLRU / S3-FIFO idea): a unit used once
  ranks as if it had been used `probation` (20 s) earlier than it was, so a one-off prompt's blocks leave
  before blocks that came back, but a block that came back is not kept forever. 20 s is short against
  a chat user's think time (longer probation evicted the next turn's prefix: -2.6 points at 60 s) and long
  enough to keep hot RAG documents over one-off questions.
- glru: s2lru's two classes plus memory across eviction (ARC's / S3-FIFO's ghost idea): a unit used by
  two requests or more ranks `protect` (30 s) younger, and an evicted run leaves a ghost (its head hash
  and use count), so a request that recomputes blocks the cache dropped re-registers them as proven: on
  the Mooncake trace the second turn of a conversation usually misses (it comes minutes later), and the
  ghost is what tells its blocks from a one-off prompt's. A longer `protect` gains more on Mooncake
  (300 s: +3 points at 5%) but keeps finished chats too long (-4 points at 20% on the chat workload).
- alru (the default; prefix/adaptive.py): glru whose `protect` is learned online from which class the
  recomputed runs were evicted from (ARC's adaptation): +1.8 points over glru at 5% on Mooncake, equal
  or better everywhere else measured.
- predict (prefix/predictive.py): learned next use: per class of (uses, last gap), a survival curve of
  the time to the next use, learned online from hits and evictions (labels delayed in ghosts, as LRB's);
  the candidate least likely to be used within the cache's characteristic time goes first.
- belady: the offline reference (replay only): evict the leaf whose next use is farthest in the future,
  and of that leaf only the tail blocks used as late as its tail (`take`); the replay tool supplies the
  future as a `NextUse` oracle. Not a proven bound: a request pins all its blocks at once.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

DEPTH_SCALE = 256.0  # blocks: a block this deep costs twice a first block to recompute
NextUse = Callable[[bytes], float]  # block hash -> when it is next used (inf: never)


class Unit(Protocol):
    """What a policy reads and writes on a cache's unit of eviction."""

    last_access: float
    hits: int  # uses since it was registered (1 at insert)
    hit_time: float  # last use (a request took it), as against last lookup (`last_access`)
    gap: float  # time between its last two uses (inf until used twice)
    priority: float  # current value; smaller is evicted first
    heap_stamp: float | None  # value of its live heap entry, None when not queued
    depth: int  # blocks from the root through the unit's last block

    @property
    def num_blocks(self) -> int: ...

    @property
    def tail_hash(self) -> bytes: ...

    @property
    def head_hash(self) -> bytes: ...

    @property
    def hashes(self) -> Sequence[bytes]: ...  # every block's hash, head first


HeapEntry = tuple[float, int, "Unit"]


def live_head(heap: list[HeapEntry], push: Callable[[Unit], None]) -> HeapEntry | None:
    """The least live entry of a lazily updated heap (`unit.heap_stamp` marks the live entry): stale
    entries are dropped and units whose priority rose since they were pushed are re-pushed by `push`,
    so policies with several heaps share one rule for what a heap's head is."""
    while heap:
        stamp, _, unit = heap[0]
        if unit.heap_stamp != stamp:
            heapq.heappop(heap)
        elif unit.priority > stamp:
            heapq.heappop(heap)
            push(unit)
        else:
            return heap[0]
    return None


class EvictionPolicy:
    """Least value first; subclasses define `value`. The base value is recency (LRU)."""

    name = "lru"

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Unit]] = []
        self._tiebreak = itertools.count()
        self.inflation = 0.0  # L: value of the last victim (aging for the frequency policies)

    def value(self, unit: Unit) -> float:
        return unit.last_access

    # ---- events from the cache ------------------------------------------------------------------

    def attach(self, num_blocks: int) -> None:
        """The cache this policy serves holds `num_blocks` blocks (sizes any history it keeps)."""

    def inserted(self, unit: Unit, now: float) -> None:
        """`unit` was registered at `now` by the request that computed it (its first use)."""
        unit.hits, unit.last_access = 1, now
        self._revalue(unit)

    def touch(self, unit: Unit, now: float) -> None:
        """`unit` was looked up at `now` (recency)."""
        unit.last_access = now
        self._revalue(unit)

    def hit(self, unit: Unit) -> None:
        """A request took `unit`'s cached blocks (frequency; once per request and unit)."""
        unit.hits += 1
        self._revalue(unit)

    def reshaped(self, unit: Unit) -> None:
        """`unit` was split or trimmed: its value may change without a use."""
        self._revalue(unit)

    def push(self, unit: Unit) -> None:
        """`unit` became a candidate (a no-op when it is queued already)."""
        if unit.heap_stamp is None:
            self._push(unit)

    def pop(self) -> Unit | None:
        """The least valued queued unit, dequeued; None when none is queued. The caller checks that it
        is still a candidate (units are not dequeued when they stop being one)."""
        heap = self._heap
        while heap:
            stamp, _, unit = heapq.heappop(heap)
            if unit.heap_stamp != stamp:
                continue  # superseded by a newer entry
            if unit.priority > stamp:
                self._push(unit)  # gained value since queued
                continue
            unit.heap_stamp = None
            return unit
        return None

    def take(self, hashes: Sequence[bytes], need: int) -> int:
        """How many tail blocks of a popped unit holding `hashes` go now (1..need): all share the
        unit's value here; a policy that values blocks one by one stops where the value changes (the
        rest of the unit is ranked again)."""
        return need

    def evicted(self, unit: Unit, run_head: bytes) -> None:
        """`unit` is being evicted, whole or from its tail starting at the block hashed `run_head`:
        age every other value up to it."""
        self.inflation = max(self.inflation, unit.priority)

    def clear(self) -> None:
        self._heap.clear()
        self.inflation = 0.0

    def queued(self) -> set[int]:
        """ids of units with a live entry (tests)."""
        return {id(unit) for stamp, _, unit in self._heap if unit.heap_stamp == stamp}

    # ---- heap ----------------------------------------------------------------------------------

    def _revalue(self, unit: Unit) -> None:
        unit.priority = self.value(unit)
        if unit.heap_stamp is not None and unit.priority < unit.heap_stamp:
            self._push(unit)  # lost value while queued: the old entry would pop too late

    def _push(self, unit: Unit) -> None:
        unit.heap_stamp = unit.priority
        heapq.heappush(self._heap, (unit.priority, next(self._tiebreak), unit))


class LFUPolicy(EvictionPolicy):
    name = "lfu"

    def value(self, unit: Unit) -> float:
        return self.inflation + unit.hits


class GDSFPolicy(EvictionPolicy):
    name = "gdsf"

    def value(self, unit: Unit) -> float:
        return self.inflation + unit.hits * (1.0 + unit.depth / DEPTH_SCALE)


class S2LRUPolicy(EvictionPolicy):
    """LRU where a unit used only once ranks `probation` seconds (of the cache's clock) older."""

    name = "s2lru"

    def __init__(self, probation: float = 20.0) -> None:
        super().__init__()
        self.probation = probation

    def value(self, unit: Unit) -> float:
        return unit.last_access - (self.probation if unit.hits <= 1 else 0.0)


class GhostLRUPolicy(EvictionPolicy):
    """LRU in two classes: a unit whose blocks were used by two requests or more (*proven*) ranks
    `protect` seconds younger, one used once ranks `probation` seconds older. What makes this more than
    S2LRU is memory across eviction (ARC's and S3-FIFO's ghosts): an evicted run of blocks leaves its
    head hash and use count behind, and a request that recomputes that run re-registers it proven. In
    a leaf-first cache the cached part of a chain always ends where its last eviction began, so the
    head of a run a request recomputes is the head of an evicted run: one ghost per eviction suffices.
    Ghosts are bounded by the pool size (oldest forgotten first)."""

    name = "glru"

    def __init__(self, protect: float = 30.0, probation: float = 20.0) -> None:
        super().__init__()
        self.protect, self.probation = protect, probation
        self.ghosts: OrderedDict[bytes, int] = OrderedDict()  # head hash of an evicted run -> its uses
        self.ghost_limit = 1024

    def attach(self, num_blocks: int) -> None:
        self.ghost_limit = max(self.ghost_limit, num_blocks)

    def value(self, unit: Unit) -> float:
        return unit.last_access + (self.protect if unit.hits >= 2 else -self.probation)

    def inserted(self, unit: Unit, now: float) -> None:
        unit.hits, unit.last_access = 1 + self.ghosts.pop(unit.head_hash, 0), now
        self._revalue(unit)

    def evicted(self, unit: Unit, run_head: bytes) -> None:
        ghosts = self.ghosts
        ghosts.pop(run_head, None)
        ghosts[run_head] = unit.hits
        if len(ghosts) > self.ghost_limit:
            ghosts.popitem(last=False)

    def clear(self) -> None:
        super().clear()
        self.ghosts.clear()


class BeladyPolicy(EvictionPolicy):
    """Farthest next use first (offline: `next_use` knows the future)."""

    name = "belady"

    def __init__(self, next_use: NextUse) -> None:
        super().__init__()
        self.next_use = next_use

    def value(self, unit: Unit) -> float:
        return -self.next_use(unit.tail_hash)

    def take(self, hashes: Sequence[bytes], need: int) -> int:
        """Only the tail blocks used next as late as the tail: a unit's head can be used much sooner
        than its tail (a later prompt may share only the head), and evicting it with the tail would
        drop blocks that are not the farthest."""
        next_use, far, k = self.next_use, self.next_use(hashes[-1]), 1
        while k < min(need, len(hashes)) and next_use(hashes[-1 - k]) == far:
            k += 1
        return min(need, k)
