"""The row cap (`engine/step_rows.py`, `--max-step-rows`): at most N running sequences compute per step, in turn.

- A hypothesis state machine plays the scheduler around `RowRotation`: groups of 1-6 sequences join (a
  newcomer computes in its admission step, beside the capped rows), sequences leave, and every step the
  chosen rows compute. It checks: never more rows than the cap; a group no larger than the cap moves
  whole; every group computes at least once every (running groups) steps; with single-sequence groups
  only, every sequence at least once every ceil(running / cap) steps.
- `--max-step-rows auto`: the cost fit recovers a step's fixed and per-row time, and the cap follows it.
- On the engine (tiny random Llama): with the cap, every running request gets a token within that bound
  (counted in steps), and beam search, n-sampling and preemption give the same results as without it.
  Greedy equality with transformers over the cap is in test_engine_equivalence.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from conftest import assert_pool_drained, random_prompts
from kvserve import LLM, BeamSearchParams, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.step_cost import MIN_SAMPLES, AutoRowCap, StepCost, cap_for, make_auto_row_cap
from kvserve.engine.step_rows import RowRotation


@dataclass(eq=False)
class Seq:
    request_id: str
    group_id: str
    num_tokens: int = 1
    num_computed_tokens: int = 0  # one token of work each step until it computes (then a new one comes)


class RotationMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.running: list[Seq] = []
        self.newcomers: list[Seq] = []  # admitted since the last step: they compute in the next one
        self.step = 0
        self.num_created = 0
        self.singles_only = True
        self.due: dict[str, int] = {}  # sequence -> the step by which it must compute again
        self.group_due: dict[str, int] = {}

    @initialize(cap=st.integers(1, 5))
    def start(self, cap):
        self.rotation = RowRotation(cap)

    @rule(size=st.sampled_from([1, 1, 1, 2, 3, 6]), at=st.integers(0, 10))
    def admit(self, size, at):
        """A new group, inserted anywhere in the running order (the pool-share order places groups)."""
        self.num_created += 1
        group_id = f"g{self.num_created}"
        members = [Seq(f"{group_id}#{i}", group_id) for i in range(size)]
        self.singles_only &= size == 1
        at = min(at, len(self.running))
        self.running[at:at] = members
        self.newcomers += members

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def finish(self, index):
        victim = self.running.pop(index % len(self.running))
        if victim in self.newcomers:
            self.newcomers.remove(victim)

    @precondition(lambda self: self.running)
    @rule(rotate=st.integers(1, 5))
    def reorder(self, rotate):
        """The scheduler reorders `running` by pool share every step."""
        rotate %= len(self.running)
        self.running = self.running[rotate:] + self.running[:rotate]

    @rule()
    def step_once(self):
        self.step += 1
        cap = self.rotation.max_rows
        older = [s for s in self.running if s not in self.newcomers]
        chosen = self.rotation.select(older)
        if chosen is None:
            assert len(older) <= cap
            computed = older
        else:
            assert 0 < len(chosen) <= cap
            computed = [s for s in older if s.request_id in chosen]
            self._check_groups_whole(older, chosen)
        computed += self.newcomers
        self.newcomers = []
        self.rotation.record(computed, self.running, self.step)
        assert set(self.rotation._served) <= {s.request_id for s in self.running}  # forgets what left
        names, groups = {s.request_id for s in computed}, {s.group_id for s in computed}
        for seq in self.running:
            assert seq.group_id in groups or self.step < self.group_due[seq.group_id], (
                f"group {seq.group_id} waited past its bound")
            if self.singles_only:
                assert seq.request_id in names or self.step < self.due[seq.request_id], f"{seq.request_id} starved"
        num_groups = len({s.group_id for s in self.running})
        for seq in computed:
            self.due[seq.request_id] = self.step + math.ceil(len(self.running) / cap)
            self.group_due[seq.group_id] = self.step + num_groups

    def _check_groups_whole(self, older: list[Seq], chosen: set[str]) -> None:
        by_group: dict[str, list[Seq]] = {}
        for seq in older:
            by_group.setdefault(seq.group_id, []).append(seq)
        for members in by_group.values():
            picked = [s for s in members if s.request_id in chosen]
            if len(members) <= self.rotation.max_rows:
                assert len(picked) in (0, len(members)), "a group within the cap was split"


TestRotation = RotationMachine.TestCase
TestRotation.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def make_llm(model_dir, **engine_args) -> LLM:
    engine_args.setdefault("num_blocks", 256)
    return LLM(str(model_dir), progress=False, **engine_args)


def test_cost_fit_and_the_cap_it_gives():
    cost = StepCost()
    for step in range(MIN_SAMPLES):
        assert cost.fit() is None  # too few steps yet
        rows = 1 + step % 8
        cost.add(rows, 0.0035 + 0.004 * rows)
    a, b = cost.fit()
    assert a == pytest.approx(0.0035) and b == pytest.approx(0.004)
    assert cap_for(a, b, 64) == 4  # ceil(4 x 3.5 / 4): keeps 80% of 1 / b
    assert cap_for(0.045, 0.006, 64) == 30  # dense weights: a large fixed part, a large cap
    assert cap_for(0.2, 0.004, 64) == 0  # an oversubscribed CPU: off
    flat = StepCost()
    for _ in range(2 * MIN_SAMPLES):
        flat.add(4, 0.02)
    assert flat.fit() is None  # rows never varied: a and b cannot be told apart


def test_auto_cap_follows_the_measured_cost():
    auto = AutoRowCap(RowRotation(0), max_num_seqs=64)
    decode = [SimpleNamespace(num_new_tokens=1)]
    chunk = [SimpleNamespace(num_new_tokens=1), SimpleNamespace(num_new_tokens=40)]
    for step in range(4 * MIN_SAMPLES):
        rows = 1 + step % 6
        auto.observe(decode * rows, 0.0035 + 0.004 * rows)
        auto.observe(chunk, 1.0)  # prefill steps are not decode rows: ignored
        if step < MIN_SAMPLES - 1:
            assert auto.rotation.max_rows == 0
    assert auto.rotation.max_rows == 4
    for step in range(8 * MIN_SAMPLES):  # the machine slows down: a step's fixed part grows 50x
        rows = 1 + step % 6
        auto.observe(decode * rows, 0.175 + 0.004 * rows)
    assert auto.rotation.max_rows == 0


def test_off_by_default_and_auto_only_when_asked_on_a_cpu(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64), progress=False)
    assert engine.auto_row_cap is None and engine.scheduler.rotation.max_rows == 0
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64, max_step_rows=None), progress=False)
    assert engine.auto_row_cap is not None and engine.scheduler.rotation.max_rows == 0  # until measured
    assert make_auto_row_cap(None, "cuda:0", RowRotation(0), 64) is None
    assert make_auto_row_cap(3, "cpu", RowRotation(3), 64) is None
    llm = make_llm(tiny_model_dir)
    assert llm.engine.auto_row_cap is None and llm.engine.scheduler.rotation.max_rows == 0
    assert make_llm(tiny_model_dir, max_step_rows=2).engine.scheduler.rotation.max_rows == 2
    with pytest.raises(ValueError, match="max_step_rows must be >= 0"):
        EngineConfig(max_step_rows=-1)


@pytest.mark.parametrize("cap", [1, 3])
def test_every_request_gets_a_token_in_turn(tiny_model_dir, cap):
    """7 decoding requests, cap N: each step computes at most N of them, and each gets a token at least
    every ceil(7 / N) steps, while a newcomer still gets its first token in the step after it arrives."""
    engine = make_llm(tiny_model_dir, max_step_rows=cap).engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in random_prompts(7, 3, 20, seed=3)]
    engine.step()  # the 7 prompts, admitted together (newcomers are not capped)
    last = dict.fromkeys(ids, 1)
    for step in range(2, 25):
        if step == 12:
            ids.append(engine.add_request([5, 6, 7], params, request_id="late"))
        outputs = {o.request_id: o for o in engine.step()}
        if step == 12:
            assert "late" in outputs  # its first step, beside the capped rows
        decoded = [r for r in outputs if r != "late" or step > 12]
        assert len(decoded) <= cap
        for request_id in outputs:
            last[request_id] = step
        assert all(step - last[r] < math.ceil(len(ids) / cap) for r in ids), (step, last)
    for request_id in ids:
        engine.abort_request(request_id)
    assert_pool_drained(engine)


@pytest.mark.parametrize(("cap", "num_blocks"), [(2, 256), (3, 256), (3, 10)])
def test_beam_search_is_unchanged(tiny_model_dir, cap, num_blocks):
    """Width-4 beams under a cap of 2 or 3 (a group above the cap takes turns within itself; its beams
    that have logits wait for their siblings) and on a pool that preempts: the same hypotheses."""
    prompts = random_prompts(3, 4, 30, seed=5)
    params = BeamSearchParams(4, max_tokens=12)
    expected = make_llm(tiny_model_dir, max_step_rows=0).beam_search(prompts, 4, 12)
    llm = make_llm(tiny_model_dir, max_step_rows=cap, num_blocks=num_blocks)
    outputs = llm.beam_search(prompts, params.beam_width, params.max_tokens)
    for a, b in zip(expected, outputs, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.score for c in a.outputs] == pytest.approx([c.score for c in b.outputs], abs=1e-4)
    if num_blocks == 10:
        assert llm.stats()["num_preemptions"] > 0
    assert_pool_drained(llm.engine)


def test_parallel_samples_move_together(tiny_model_dir):
    """n=3 samples and single requests under a cap of 3: a step computes all of a group's samples or
    none, the samples finish with their full length, and every block comes back."""
    engine = make_llm(tiny_model_dir, max_step_rows=3).engine
    group = engine.add_request([5, 6, 7], SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=2,
                                                         ignore_eos=True))
    singles = [engine.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True))
               for p in random_prompts(3, 3, 12, seed=4)]
    schedule, sizes = engine.scheduler.schedule, []

    def spy():  # what each step schedules for the group
        output = schedule()
        sizes.append(sum(item.request.group_id == group for item in output.scheduled))
        return output

    engine.scheduler.schedule = spy
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step()})
    assert set(sizes) == {0, 1, 3}  # 1: the prompt, before the fork
    assert [len(c.token_ids) for c in final[group].outputs] == [10, 10, 10]
    assert all(len(final[r].outputs[0].token_ids) == 10 for r in singles)
    assert_pool_drained(engine)


def test_the_flag_takes_a_count_0_or_auto():
    import argparse

    from kvserve.cli import add_engine_flags, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config_from_args(parser.parse_args([])).max_step_rows == 0  # off: measured no help idle
    assert engine_config_from_args(parser.parse_args(["--max-step-rows", "auto"])).max_step_rows is None
    assert engine_config_from_args(parser.parse_args(["--max-step-rows", "0"])).max_step_rows == 0
    assert engine_config_from_args(parser.parse_args(["--max-step-rows", "6"])).max_step_rows == 6
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-step-rows", bad])
