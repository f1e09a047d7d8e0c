"""Background requests under a hypothesis state machine over a real engine (tiny random Llama, a small
pool): callers and background copies arrive with shared prefixes, steps run, requests are aborted.

After every step the engine's own checks hold (KVSERVE_DEBUG_CHECKS: no block both free and in use,
ref counts, free + cached + in use = total), and the background rules of engine/background.py:
- no background request computes a token in a step that began with a caller waiting or running;
- a step that began with no caller evicts no cached block (a copy never evicts);
- a background request computes at most BACKGROUND_CHUNK_TOKENS a step;
- the server's load counts leave background requests out;
and at the end every request finishes (or is dropped with its error) and every block comes back.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from conftest import assert_pool_drained
from kvserve.config import EngineConfig
from kvserve.engine.background import BACKGROUND_CHUNK_TOKENS
from kvserve.engine.engine import LLMEngine
from kvserve.engine.params import SamplingParams

PREFIXES = [[7 + (i * 13 + p) % 360 for i in range(160)] for p in range(3)]


class BackgroundMachine(RuleBasedStateMachine):
    model_dir = None

    def __init__(self) -> None:
        super().__init__()
        self.engine = LLMEngine(EngineConfig(model=str(self.model_dir), num_blocks=40, max_num_seqs=4,
                                             max_num_batched_tokens=256), progress=False)
        self.count = 0

    def _prompt(self, prefix: int, length: int, tail: int) -> list[int]:
        return PREFIXES[prefix][:length] + [370 + tail, 371 + tail]

    @rule(prefix=st.integers(0, 2), length=st.integers(8, 160), tail=st.integers(0, 5),
          max_tokens=st.integers(1, 6))
    def add_caller(self, prefix, length, tail, max_tokens):
        self.count += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(self._prompt(prefix, length, tail), params, request_id=f"c{self.count}")

    @rule(prefix=st.integers(0, 2), length=st.integers(8, 160), tail=st.integers(0, 5))
    def add_background(self, prefix, length, tail):
        self.count += 1
        request = self.engine.make_request(self._prompt(prefix, length, tail), SamplingParams(max_tokens=1),
                                           request_id=f"b{self.count}")
        request.background = True
        self.engine.add(request)

    @rule(index=st.integers(0, 50))
    def abort(self, index):
        ids = sorted(self.engine.groups)
        if ids:
            self.engine.abort_request(ids[index % len(ids)])

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self._checked_step()

    def _checked_step(self) -> None:
        scheduler = self.engine.scheduler
        callers = any(not r.background for r in [*scheduler.running, *scheduler.waiting])
        evictions = self.engine.stats()["evictions"]
        outputs = []
        schedule = scheduler.schedule
        scheduler.schedule = lambda: outputs.append(schedule()) or outputs[-1]  # what the step scheduled
        try:
            self.engine.step()
        finally:
            scheduler.schedule = schedule
        for item in outputs[0].scheduled:
            if item.request.background:
                assert not callers, f"{item.request.request_id} computed while a caller waited or ran"
                assert item.num_new_tokens <= BACKGROUND_CHUNK_TOKENS
        if not callers:
            assert self.engine.stats()["evictions"] == evictions, "a background step evicted a cached block"

    @invariant()
    def load_counts_leave_background_out(self):
        scheduler, stats = self.engine.scheduler, self.engine.stats()
        assert stats["num_running"] == sum(not r.background for r in scheduler.running)
        assert stats["num_waiting"] == sum(not r.background for r in scheduler.waiting)

    def teardown(self) -> None:
        for _ in range(400):
            if not self.engine.has_unfinished_requests():
                break
            self._checked_step()
        assert not self.engine.has_unfinished_requests() and not self.engine.groups
        assert_pool_drained(self.engine)


@pytest.fixture(scope="module")
def machine_model_dir(tmp_path_factory):
    from test_server_support import make_chat_model_dir

    return make_chat_model_dir(tmp_path_factory.mktemp("bgprop") / "tiny", max_position_embeddings=512)


def test_background_rules_hold_under_random_traffic(machine_model_dir):
    BackgroundMachine.model_dir = machine_model_dir
    BackgroundMachine.TestCase.settings = settings(
        max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck))
    BackgroundMachine.TestCase().runTest()
