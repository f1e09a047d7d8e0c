"""Pool accounting with the host and disk tiers on: random requests, steps and aborts (hypothesis),
so admissions load from host (synchronously) and disk (requests in WAITING_FOR_KV hold blocks)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.engine.request import RequestStatus
from kvserve.prefix.namespace import make_namespace
from test_engine_pool_properties import SHARED_PREFIX, apply_step_or_abort, drain_checking, operation


@pytest.fixture(scope="module", params=["radix", "hash"])
def engine(request, tiny_model_dir, tmp_path_factory):
    # A pool of 10 blocks, a host tier of ~6 blocks: evictions go to host and on to disk all the time.
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=10, block_size=16, prefix_cache=request.param,
              max_num_batched_tokens=40, host_cache="40KiB", disk_cache=str(tmp_path_factory.mktemp("disk")))
    yield llm.engine
    llm.engine.close()


def check_tiers(engine) -> None:
    """The engine's own live checks (requests in WAITING_FOR_KV count as holders), the pool accounting,
    and every tier's. (`check_pool` counts running requests only, so it cannot be used here.)"""
    engine.scheduler.check_invariants()
    allocator, cache = engine.block_manager.allocator, engine.block_manager.prefix_cache
    assert all(count >= 0 for count in allocator.ref_counts)
    assert allocator.num_free + cache.num_evictable_blocks + allocator.num_referenced() == allocator.num_blocks
    for request in engine.tiers.holders():
        assert request.status is RequestStatus.WAITING_FOR_KV and request.block_table
    engine.tiers.policy.check_invariants()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(operation, min_size=1, max_size=30), seed=st.integers(0, 2**16))
def test_random_operations_with_tiers_keep_pool_consistent(engine, ops, seed):
    ids: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, shared, salt, *_ = op  # (the pool test also draws an adapter)
            prompt = (SHARED_PREFIX + [seed % 7 + 60] * length) if shared else [(seed % 5 + i) % 500 + 3
                                                                                 for i in range(length)]
            prompt = prompt[: 150 - max_tokens]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            ids.append(engine.add_request(prompt, params, namespace=make_namespace(f"s{salt}" if salt else None)))
        else:
            apply_step_or_abort(engine, op, ids)
        check_tiers(engine)
    drain_checking(engine, check_tiers)
    assert not engine.tiers.loading


def test_a_fixed_run_takes_every_path_with_the_checks_on(tiny_model_dir, tmp_path):
    """The random runs above may or may not reach every path; this one does: a prompt evicted to host
    and on to disk comes back through WAITING_FOR_KV, with the pool checks after every step."""
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=10, block_size=16, max_num_batched_tokens=40,
              host_cache="40KiB", disk_cache=str(tmp_path / "disk"))
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    statuses: set[RequestStatus] = set()
    fillers = [[300 + i] * 60 for i in range(4)]  # distinct prompts that push the shared one down the tiers
    for prompt in [SHARED_PREFIX + [7] * 20, *fillers, SHARED_PREFIX + [7] * 20, fillers[0]]:
        request = engine.make_request(prompt, params)
        engine.add(request)
        while engine.has_unfinished_requests():
            engine.step()
            statuses.add(request.status)
            check_tiers(engine)
        engine.tiers.policy.flush()
    stats = engine.stats()["tiers"]
    assert stats["disk"]["load"]["blocks"] > 0 and stats["host"]["puts"] > 0
    assert RequestStatus.WAITING_FOR_KV in statuses
    engine.close()
