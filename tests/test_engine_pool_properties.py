"""Pool accounting under random mixes of requests, steps, aborts and preemptions (hypothesis).

Each request runs under a random LoRA adapter (or none): three adapters through two slots, so steps
mix adapters, swap slots and split; adapters change the cache keys but never the accounting.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import assert_pool_drained
from kvserve import LLM, SamplingParams
from kvserve.engine.busy_chunk import BusyChunking
from kvserve.prefix.namespace import make_namespace
from lora_util import make_peft_adapter

SHARED_PREFIX = list(range(10, 58))  # 48 tokens: three blocks of 16 that requests may share


def check_pool(engine) -> None:
    manager = engine.block_manager
    allocator, cache = manager.allocator, manager.prefix_cache
    assert all(count >= 0 for count in allocator.ref_counts)
    for block_id in range(allocator.num_blocks):
        if allocator.is_free(block_id):
            assert allocator.ref_counts[block_id] == 0, f"block {block_id} free and referenced"
    assert allocator.num_free + cache.num_evictable_blocks + allocator.num_referenced() == allocator.num_blocks
    held: dict[int, int] = {}
    for request in engine.scheduler.running:
        for block_id in request.block_table:
            assert not allocator.is_free(block_id), f"running request holds free block {block_id}"
            held[block_id] = held.get(block_id, 0) + 1
    for block_id, holders in held.items():
        assert allocator.ref_counts[block_id] == holders  # exactly one reference per holder
    for request in engine.scheduler.waiting:
        assert request.block_table == []
    if hasattr(cache, "check_invariants"):
        cache.check_invariants()


def apply_step_or_abort(engine, op: tuple, ids: list[str]) -> None:
    """The operations every pool property test shares: ("step", n) runs n steps, ("abort", i) aborts one,
    ("chunking", threshold, always, busy) sets the long-prefill cap (0: off; below the tests' 40-token budget, so it
    bites), whether it applies to a prompt alone too (`--long-prefill-always`), and busy chunking's chunk
    (`engine/busy_chunk.py`, 0: off) for prompts computing 20 tokens or more."""
    if op[0] == "step":
        for _ in range(op[1]):
            engine.step()
    elif op[0] == "chunking":
        engine.scheduler.long_prefill_token_threshold, engine.scheduler.long_prefill_always = op[1], op[2]
        engine.scheduler.busy = BusyChunking(op[3], min_uncached=20)
    elif ids:
        engine.abort_request(ids[op[1] % len(ids)])


MAX_DRAIN_STEPS = 5000  # far beyond what any generated example needs: more is a livelock, failed loudly


def drain_checking(engine, *checks) -> None:
    """Step until idle, running every check after each step; then every block must be back."""
    for _ in range(MAX_DRAIN_STEPS):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        for check in checks:
            check(engine)
    assert not engine.has_unfinished_requests(), f"no drain after {MAX_DRAIN_STEPS} steps (livelock)"
    assert_pool_drained(engine)


operation = st.one_of(
    st.tuples(
        st.just("add"), st.integers(1, 70), st.integers(1, 20), st.booleans(), st.integers(0, 2), st.integers(0, 3)
    ),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("chunking"), st.sampled_from([0, 16, 24]), st.booleans(), st.sampled_from([0, 8])),
)


@pytest.fixture(scope="module", params=["radix", "hash", "off"])
def engine(request, tiny_model_dir, tmp_path_factory):
    # 10 blocks of 16 tokens: a few requests fill it, so preemption and eviction are common.
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=10, block_size=16,
              prefix_cache=request.param, max_num_batched_tokens=40, enable_lora=True, max_loras=2, max_lora_rank=4)
    root = tmp_path_factory.mktemp("pool-adapters")
    engine = llm.engine
    engine.test_adapters = [None] + [
        engine.load_lora(f"l{i}", str(make_peft_adapter(tiny_model_dir, root / f"l{i}", seed=i, rank=2 + i % 2)))
        for i in range(3)
    ]
    return engine


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(operation, min_size=1, max_size=30), seed=st.integers(0, 2**16))
def test_random_operations_keep_pool_consistent(engine, ops, seed):
    ids: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, shared, salt, adapter = op
            prompt = (SHARED_PREFIX + [seed % 400 + 60] * length) if shared else [(seed + i) % 500 + 3
                                                                                    for i in range(length)]
            prompt = prompt[: 150 - max_tokens]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if salt else 0.8, seed=seed,
                                    ignore_eos=True)
            request = engine.make_request(prompt, params, namespace=make_namespace(f"s{salt}" if salt else None),
                                          lora=engine.test_adapters[adapter])
            ids.append(engine.add(request))
        else:
            apply_step_or_abort(engine, op, ids)
        check_pool(engine)
    drain_checking(engine, check_pool)
