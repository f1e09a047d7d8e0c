"""`PoolShare.order` (counts kept between steps) equals `order_by_pool_share` (from scratch) on every step.

A hypothesis state machine plays the scheduler and the block manager: sequences join (new groups, or
forks sharing a sibling's blocks), leave, grow, copy a shared tail on write, adopt a sibling's block,
are re-admitted (a later `held_since_step`), each table edit taking a fresh `table_version` as the
block manager gives it, and every step the running list is reordered by both functions from the same
input order. Block ids come from a small range and arrival times from a few values, so shared
blocks, equal weights (the sort is stable: ties keep the previous order) and equal arrivals are common.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.engine.pool_share import PoolShare, order_by_pool_share

BLOCK_IDS = st.integers(0, 40)


@dataclass(eq=False)
class Metrics:
    arrival_time: float


@dataclass(eq=False)
class Seq:
    request_id: str
    group_id: str
    metrics: Metrics
    held_since_step: int = 0
    block_table: list[int] = field(default_factory=list)
    table_version: int = 0
    num_tokens: int = 1  # computing (not waiting for its group)
    num_computed_tokens: int = 0


class OrderMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool_share = PoolShare()
        self.running: list[Seq] = []
        self.step = 0
        self.num_created = 0
        self.versions = itertools.count(1)

    def _edited(self, request: Seq) -> None:
        request.table_version = next(self.versions)

    def _new_id(self) -> str:
        self.num_created += 1
        return f"r{self.num_created}"

    @rule(blocks=st.lists(BLOCK_IDS, max_size=12, unique=True), arrival=st.integers(0, 3))
    def admit(self, blocks, arrival):
        request_id = self._new_id()
        self.running.append(Seq(request_id, request_id, Metrics(float(arrival)), self.step, list(blocks)))
        self._edited(self.running[-1])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.running))
        child = Seq(f"{parent.group_id}#{self._new_id()}", parent.group_id, parent.metrics, self.step,
                    list(parent.block_table))
        self.running.append(child)
        self._edited(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def leave(self, data):  # finished, aborted or preempted
        self.running.remove(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), blocks=st.lists(BLOCK_IDS, min_size=1, max_size=3))
    def grow(self, data, blocks):
        request = data.draw(st.sampled_from(self.running))
        request.block_table.extend(blocks)
        self._edited(request)

    @precondition(lambda self: any(r.block_table for r in self.running))
    @rule(data=st.data(), block=BLOCK_IDS)
    def replace_one_block(self, data, block):  # copy-on-write of a tail, or adopting a cached duplicate
        request = data.draw(st.sampled_from([r for r in self.running if r.block_table]))
        index = data.draw(st.integers(0, len(request.block_table) - 1))
        request.block_table[index] = block
        self._edited(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def readmit(self, data):  # preempted and admitted again: held from now, its table rebuilt
        request = data.draw(st.sampled_from(self.running))
        request.held_since_step = self.step
        request.block_table = list(request.block_table)
        self._edited(request)

    @rule(num_steps=st.integers(1, 30))
    def time_passes(self, num_steps):
        self.step += num_steps

    @invariant()
    def orders_agree(self):
        self.step += 1
        expected = order_by_pool_share(self.running, self.step)
        got = self.pool_share.order(self.running, self.step)
        assert [r.request_id for r in got] == [r.request_id for r in expected]
        assert all(a is b for a, b in zip(got, expected, strict=True))
        self.pool_share.check(self.running)
        self.running = got  # the scheduler keeps the order it got, so ties keep it next step


OrderMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestOrderMachine = OrderMachine.TestCase


def test_check_catches_a_table_edited_without_a_new_version():
    pool_share = PoolShare()
    request = Seq("a", "a", Metrics(0.0), 0, [1, 2], table_version=1)
    pool_share.order([request], step=1)
    pool_share.check([request])
    request.block_table.append(3)  # an edit that skipped the block manager's version
    with pytest.raises(AssertionError, match="kept 2 blocks, holds 3"):
        pool_share.check([request])
