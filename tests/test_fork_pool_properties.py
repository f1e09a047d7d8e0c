"""Pool accounting with forked sequences: random mixes of plain, parallel (n / best_of) and beam-search
requests, steps and aborts on a pool small enough that preemption and copy-on-write interleave."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, BeamSearchParams, SamplingParams
from test_engine_pool_properties import apply_step_or_abort, check_pool, drain_checking

SHARED_PREFIX = list(range(10, 45))  # 35 tokens: two full blocks and a partial one


operation = st.one_of(
    st.tuples(st.just("plain"), st.integers(1, 40), st.integers(1, 12)),
    st.tuples(st.just("parallel"), st.integers(1, 40), st.integers(1, 12), st.integers(2, 5), st.booleans()),
    st.tuples(st.just("beam"), st.integers(1, 40), st.integers(1, 12), st.integers(1, 4)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


@pytest.fixture(scope="module", params=["radix", "hash", "off"])
def engine(request, tiny_model_dir):
    # 12 blocks of 16, max_num_seqs 6: a few groups exhaust both, so every path is hit.
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=12, block_size=16,
              prefix_cache=request.param, max_num_batched_tokens=48, max_num_seqs=6)
    return llm.engine


def params_for(op: tuple, seed: int) -> SamplingParams | BeamSearchParams:
    kind, _, max_tokens = op[:3]
    if kind == "beam":
        return BeamSearchParams(op[3], max_tokens=max_tokens)
    if kind == "parallel":
        n, ranked = op[3], op[4]
        return SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=seed, n=n,
                              best_of=n + 1 if ranked else None)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def check_groups(engine) -> None:
    assert engine.block_manager.pending_copies == []  # every copy ran with its step
    for group in engine.groups.values():
        for sequence in group.sequences():
            if not sequence.is_finished:
                assert sequence in engine.scheduler.running or sequence in engine.scheduler.waiting


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(operation, min_size=1, max_size=25), seed=st.integers(0, 2**16))
def test_random_group_operations_keep_pool_consistent(engine, ops, seed):
    ids: list[str] = []
    for op in ops:
        if op[0] in ("plain", "parallel", "beam"):
            prompt = (SHARED_PREFIX + [seed % 400 + 60] * op[1])[: 120 - op[2]]
            ids.append(engine.add_request(prompt, params_for(op, seed)))
        else:
            apply_step_or_abort(engine, op, ids)
        check_pool(engine)
        check_groups(engine)
    drain_checking(engine, check_pool)
    assert not engine.groups and not engine.requests
