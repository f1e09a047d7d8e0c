"""alru's adaptation (prefix/adaptive.py) and the replay's diagnostic oracles (replay/oracles.py), on
hand-made units so each ranking rule is checked on its own."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from kvserve.prefix.adaptive import AdaptiveGhostLRUPolicy
from kvserve.prefix.policies import ONLINE_POLICIES, make_policy
from kvserve.replay.oracles import ORACLE_POLICIES, make_oracle


@dataclass(slots=True, eq=False)
class FakeUnit:
    name: bytes
    last_access: float = 0.0
    hits: int = 1
    priority: float = 0.0
    heap_stamp: float | None = None
    depth: int = 1

    @property
    def num_blocks(self) -> int:
        return 1

    @property
    def tail_hash(self) -> bytes:
        return self.name

    @property
    def head_hash(self) -> bytes:
        return self.name


def queue(policy, units: list[FakeUnit], when: list[float], hits: list[int]) -> None:
    for unit, now, count in zip(units, when, hits, strict=True):
        policy.inserted(unit, now)
        for _ in range(count - 1):
            policy.hit(unit)
        policy.push(unit)


@pytest.mark.parametrize(("protect", "first"), [(100.0, "once"), (1.0, "proven")])
def test_alru_compares_the_classes_at_the_current_protect(protect: float, first: str) -> None:
    """protect moves with no unit being used: the choice between the two heads follows it at once."""
    policy = AdaptiveGhostLRUPolicy(protect=30.0, probation=20.0)
    proven, once = FakeUnit(b"p"), FakeUnit(b"o")
    queue(policy, [proven, once], [0.0, 50.0], [2, 1])  # proven ranks 0 + protect, once 50 - 20 = 30
    policy.protect = protect
    assert policy.pop().name.decode() == first[0]
    assert policy.pop() is not None and policy.pop() is None
    assert policy.queued() == set()


def test_alru_learns_protect_from_which_class_came_back() -> None:
    policy = AdaptiveGhostLRUPolicy(protect=30.0, low=1.0, high=60.0)
    proven, once = FakeUnit(b"p", hits=3), FakeUnit(b"o", hits=1)
    policy.evicted(proven, b"p")
    policy.evicted(once, b"o")
    back = FakeUnit(b"p")
    policy.inserted(back, 10.0)  # a proven run recomputed: protection was too short
    assert policy.protect > 30.0 and back.hits == 4
    raised = policy.protect
    again = FakeUnit(b"o")
    policy.inserted(again, 11.0)  # a once-used run recomputed: the recency side was too small
    assert policy.protect < raised and again.hits == 2
    for i in range(500):  # bounded both ways
        policy.evicted(FakeUnit(b"x", hits=2), b"x%d" % i)
        policy.inserted(FakeUnit(b"x%d" % i), 12.0 + i)
    assert policy.protect == 60.0
    fresh = FakeUnit(b"new")
    policy.inserted(fresh, 600.0)  # no ghost: used once, protect untouched
    assert fresh.hits == 1 and policy.protect == 60.0


def test_oracles_are_not_engine_policies() -> None:
    assert not set(ORACLE_POLICIES) & set(ONLINE_POLICIES)
    for name in ORACLE_POLICIES:
        with pytest.raises(ValueError, match="unknown eviction policy"):
            make_policy(name)
    with pytest.raises(ValueError, match="unknown oracle"):
        make_oracle("oracle-soon", lambda h: 0.0, lambda: 0.0)


def test_reuse_oracle_evicts_the_dead_first_then_lru() -> None:
    future = {b"old": 500.0, b"mid": 400.0}  # "new" is never used again
    policy = make_oracle("oracle-reuse", lambda h: future.get(h, math.inf), lambda: 0.0)
    units = [FakeUnit(b"old"), FakeUnit(b"mid"), FakeUnit(b"new")]
    queue(policy, units, [1.0, 2.0, 3.0], [1, 1, 1])
    assert [policy.pop().name for _ in range(3)] == [b"new", b"old", b"mid"]


def test_horizon_oracle_revalues_a_unit_whose_use_came_near_while_queued() -> None:
    clock = [0.0]
    future = {b"soon": 30.0, b"later": 100.0}
    policy = make_oracle("oracle-h60", lambda h: future.get(h, math.inf), lambda: clock[0])
    soon, later = FakeUnit(b"soon"), FakeUnit(b"later")
    queue(policy, [soon, later], [1.0, 2.0], [1, 1])  # at 0: only "soon" within 60 s
    clock[0] = 50.0  # now both are: LRU between them
    assert policy.pop() is soon
    assert [u.name for u in [policy.pop()]] == [b"later"] and policy.pop() is None
    clock[0] = 0.0
    queue(policy, [soon, later], [1.0, 2.0], [1, 1])
    assert policy.pop() is later  # at 0 "later" is beyond the horizon: it goes first though newer
