"""`predict` (prefix/predictive.py): its survival model, its delayed labels and its ranking, on hand-made
units so each rule is checked on its own. (The caches, replay, state machines and engine equivalence run
it through the registry's parametrised tests.)"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from kvserve.prefix.policies import ONLINE_POLICIES, make_policy
from kvserve.prefix.predictive import NUM_CLASSES, NextUsePolicy, SurvivalModel, time_position, unit_class


@dataclass(slots=True, eq=False)
class FakeUnit:
    name: bytes
    run: tuple[bytes, ...] = ()  # the blocks' hashes when more than one (else just `name`)
    last_access: float = 0.0
    hits: int = 1
    hit_time: float = 0.0
    gap: float = math.inf
    priority: float = 0.0
    heap_stamp: float | None = None
    depth: int = 1

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    @property
    def hashes(self) -> tuple[bytes, ...]:
        return self.run or (self.name,)

    @property
    def tail_hash(self) -> bytes:
        return self.hashes[-1]

    @property
    def head_hash(self) -> bytes:
        return self.hashes[0]


def use(policy: NextUsePolicy, unit: FakeUnit, now: float) -> None:
    """What a cache does when a request takes a unit: look it up, then acquire it."""
    policy.touch(unit, now)
    policy.hit(unit)


def test_predict_is_an_engine_policy_and_classes_are_in_range() -> None:
    assert "predict" in ONLINE_POLICIES and isinstance(make_policy("predict"), NextUsePolicy)
    assert unit_class(1, math.inf) == 0 and unit_class(1, 5.0) == 0  # used once: one class whatever the gap
    gaps = (0.0, 9.9, 20.0, 50.0, 100.0, 500.0, 1e4, math.inf)
    seen = {unit_class(hits, gap) for hits in range(1, 9) for gap in gaps}
    assert seen == set(range(NUM_CLASSES))


def test_survival_curve_is_kaplan_meier_with_censoring() -> None:
    model = SurvivalModel(half_life=10**9)  # no aging: counts are plain
    for _ in range(30):
        model.observe(1, 2.0, True)  # 30 units used again 2 s later
        model.observe(1, 100.0, False)  # 30 not used for at least 100 s
    model.refit()
    early, late = model.survival(1, 1.0), model.survival(1, 50.0)
    assert early == pytest.approx(1.0, abs=0.05)  # nothing happens before 2 s (prior aside)
    assert late == pytest.approx(0.5, abs=0.05)  # half came back at 2 s, the rest are still at risk
    assert model.use_within(1, 0.0, 10.0) == pytest.approx(0.5, abs=0.05)
    assert model.use_within(1, 10.0, 10.0) < 0.05  # past the 2 s bump: survivors do not come back soon


def test_censoring_can_be_moved_and_taken_back() -> None:
    model = SurvivalModel(half_life=100)
    weight = model.observe(2, 5.0, False)
    for _ in range(500):  # aging rescales the tables: the handle must still find the right amount
        model.observe(0, 1.0, True)
    bucket = int(time_position(5.0))
    before = model.censored[2][bucket]
    assert before > 0
    model.move_censoring(2, bucket, weight, bucket + 3)
    assert model.censored[2][bucket] == pytest.approx(0.0, abs=1e-9 * before)
    assert model.censored[2][bucket + 3] == pytest.approx(before)
    model.move_censoring(2, bucket + 3, weight, None)
    assert sum(model.censored[2]) == pytest.approx(0.0, abs=1e-9 * before)


def test_a_ghost_turns_its_censoring_into_an_event_at_the_true_gap() -> None:
    policy = NextUsePolicy(refit=1)
    unit = FakeUnit(b"run")
    policy.inserted(unit, 0.0)
    use(policy, unit, 4.0)  # second use: class (2 uses, gap 4 s)
    cls = unit_class(unit.hits, unit.gap)
    policy.touch(FakeUnit(b"clock"), 10.0)
    policy.evicted(unit, b"run")
    model = policy.model
    assert sum(model.censored[cls]) > 0 and sum(model.events[cls]) == 0
    policy.touch(FakeUnit(b"clock"), 200.0)
    policy._advance()  # the ghost stays unused: its censoring follows its age
    assert max(range(len(model.censored[cls])), key=model.censored[cls].__getitem__) == int(time_position(196.0))
    back = FakeUnit(b"run")
    policy.inserted(back, 300.0)  # recomputed: it was used after all, 296 s after its last use
    assert sum(model.censored[cls]) == pytest.approx(0.0, abs=1e-9)
    assert model.events[cls][int(time_position(296.0))] > 0
    assert back.hits == 3 and back.gap == pytest.approx(296.0)


def test_learns_which_class_comes_back_and_evicts_the_other_first() -> None:
    """Units used three times come back 2 s later, half the units used once never do: after training,
    a thrice-used unit idle for 1.5 s is kept over a once-used one idle for 0.5 s (LRU: the opposite)."""
    policy = NextUsePolicy(refit=16)
    now = 0.0
    for i in range(300):
        hot, cold = FakeUnit(b"h%d" % i), FakeUnit(b"c%d" % i)
        policy.inserted(hot, now)
        policy.inserted(cold, now)
        for k in (1, 2, 3):
            use(policy, hot, now + 2.0 * k)  # each use 2 s after the last
        now += 10.0
        policy.touch(FakeUnit(b"clock"), now)
        policy.evicted(cold, cold.name)  # never used again
    hot, cold = FakeUnit(b"H"), FakeUnit(b"C")
    policy.inserted(hot, now)
    use(policy, hot, now + 1.0)
    use(policy, hot, now + 3.0)  # three uses, last gap 2 s
    policy.push(hot)
    policy.inserted(cold, now + 4.0)
    policy.push(cold)
    policy.touch(FakeUnit(b"clock"), now + 4.5)
    assert policy.model.use_within(0, 0.5, 20.0) < policy.model.use_within(unit_class(hot.hits, hot.gap), 1.5, 20.0)
    assert policy.pop() is cold
    assert policy.pop() is hot and policy.pop() is None
    assert policy.queued() == set()


def test_within_a_class_the_oldest_goes_first_and_clear_forgets() -> None:
    policy = NextUsePolicy()
    units = [FakeUnit(b"%d" % i) for i in range(5)]
    for i, unit in enumerate(units):
        policy.inserted(unit, float(i))
        policy.push(unit)
    policy.touch(units[0], 10.0)  # looked up again: youngest now
    assert [policy.pop() for _ in range(5)] == [*units[1:], units[0]]
    policy.evicted(units[1], b"1")
    policy.clear()
    assert policy.pop() is None and not policy.ghosts


def test_forgotten_ghosts_stay_censored_and_their_timers_are_dropped() -> None:
    policy = NextUsePolicy(refit=10**9)
    policy.ghost_limit = 4
    for i in range(40):
        policy.touch(FakeUnit(b"clock"), float(i))
        policy.evicted(FakeUnit(b"%d" % i, hit_time=float(i)), b"%d" % i)
    assert len(policy.ghosts) == 4
    censored = sum(map(sum, policy.model.censored))
    assert censored > 0
    policy._advance()
    assert len(policy._crossings) <= 2 * 4 + 4  # bounded by the ghosts still open
    assert sum(map(sum, policy.model.censored)) == pytest.approx(censored)  # moved, never lost


def test_a_recomputed_chain_labels_every_evicted_run_in_it() -> None:
    """A chain evicted leaf first (child run, then parent run) and recomputed as one new unit: both
    ghosts' censorings become events, and the unit inherits the history of the run at its head."""
    policy = NextUsePolicy(refit=1)
    parent, child = FakeUnit(b"p", run=(b"p0", b"p1")), FakeUnit(b"c", run=(b"c0", b"c1", b"c2"))
    for unit in (parent, child):
        policy.inserted(unit, 0.0)
        use(policy, unit, 5.0)
    policy.touch(FakeUnit(b"clock"), 50.0)
    policy.evicted(child, b"c0")
    policy.evicted(parent, b"p0")
    model, cls = policy.model, unit_class(2, 5.0)
    assert sum(model.censored[cls]) == pytest.approx(5.0 * model.weight, rel=0.01)  # weighted by blocks
    again = FakeUnit(b"p0", run=(b"p0", b"p1", b"c0", b"c1", b"c2"))
    policy.inserted(again, 100.0)
    assert not policy.ghosts
    assert sum(model.censored[cls]) == pytest.approx(0.0, abs=1e-6)
    assert model.events[cls][int(time_position(95.0))] > 0
    assert again.hits == 3 and again.gap == pytest.approx(95.0)
