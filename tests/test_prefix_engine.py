"""Prefix caching through the engine (tiny random Llama, block size 16), for radix and hash."""

from __future__ import annotations

import pytest

from conftest import assert_pool_drained, hf_greedy, random_prompts
from kvserve import LLM, SamplingParams
from kvserve.prefix.policies import DEFAULT_EVICTION, ONLINE_POLICIES

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BASE = list(range(100, 160))  # 60 distinct token ids


@pytest.fixture(params=["radix", "hash"])
def llm(request, tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), progress=False, num_blocks=64, block_size=16, prefix_cache=request.param)


def cached_tokens(llm: LLM, prompt: list[int], salt: str | None = None) -> int:
    return llm.generate([prompt], GREEDY, cache_salt=salt)[0].num_cached_tokens


def test_shared_48_of_53(llm):
    assert cached_tokens(llm, BASE[:55]) == 0
    assert cached_tokens(llm, BASE[:48] + [7, 8, 9, 10, 11]) == 48


def test_identical_48_recomputes_last_block(llm):
    assert cached_tokens(llm, BASE[:48]) == 0
    assert cached_tokens(llm, BASE[:48]) == 32


def test_49_after_48(llm):
    cached_tokens(llm, BASE[:48])
    assert cached_tokens(llm, BASE[:49]) == 48


def test_same_salt_hits_other_salt_misses(llm):
    assert cached_tokens(llm, BASE[:40], salt="alice") == 0
    assert cached_tokens(llm, BASE[:40], salt="alice") == 32  # positive half: caching works
    assert cached_tokens(llm, BASE[:40], salt="bob") == 0  # negative half: namespaces never share
    assert cached_tokens(llm, BASE[:40]) == 0  # no salt is a namespace of its own


def test_short_prompt_never_hits(llm):
    cached_tokens(llm, BASE[:15])
    assert cached_tokens(llm, BASE[:15]) == 0
    assert cached_tokens(llm, BASE[:16]) == 0  # one full block, but the last token is always computed


def test_answer_is_reusable_next_turn(llm):
    first = llm.generate([BASE[:20]], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    history = BASE[:20] + first.token_ids  # 50 tokens; KV exists for the first 49
    follow_up = history + [3, 4, 5, 6]
    assert cached_tokens(llm, follow_up) == 48


def test_concurrent_request_hits_blocks_published_during_prefill(llm):
    engine = llm.engine
    engine.scheduler.prefix_hold = None  # B would wait for A's third block (tests/test_prefix_hold.py)
    engine.scheduler.max_num_batched_tokens = 32  # A's 60-token prompt takes two prefill steps
    first = engine.add_request(BASE[:60], GREEDY)
    engine.step()  # A has computed 32 tokens: two full blocks, published at once
    second = engine.make_request(BASE[:60] + [1], GREEDY)
    engine.add(second)
    engine.step()
    assert second.num_cached_tokens == 32
    while engine.has_unfinished_requests():
        engine.step()
    assert first not in engine.requests
    assert_pool_drained(engine)


def test_invalid_salt_rejected(llm):
    for salt in ["", "a/b", "a@b", "a\\b", "a\x00b", "x" * 129]:
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate([BASE[:20]], GREEDY, cache_salt=salt)
    assert cached_tokens(llm, BASE[:20], salt="x" * 128) == 0


def test_stats_counters(llm):
    cached_tokens(llm, BASE[:48])
    cached_tokens(llm, BASE[:48])
    stats = llm.stats()
    assert stats["prefix_cache_queries"] == 96 and stats["prefix_cache_hits"] == 32
    assert stats["prefix_cache_hit_rate"] == pytest.approx(32 / 96)
    assert stats["cached_blocks"] == 3 and stats["used_blocks"] == 0


def test_reset_prefix_cache(llm):
    cached_tokens(llm, BASE[:48])
    stream = llm.stream(BASE[:40], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    next(stream)
    assert llm.reset_prefix_cache() is False  # a block is in use
    stream.close()
    assert llm.reset_prefix_cache() is True
    stats = llm.stats()
    assert stats["cached_blocks"] == 0 and stats["free_blocks"] == stats["num_blocks"]
    assert cached_tokens(llm, BASE[:48]) == 0


def test_lru_eviction_keeps_shared_prefix(tiny_model_dir, request):
    for kind in ("radix", "hash"):
        # host_cache=0: this is the device's own LRU (with a host tier the evicted tail comes back from RAM)
        llm = LLM(str(tiny_model_dir), progress=False, num_blocks=8, block_size=16, prefix_cache=kind, host_cache=0)
        shared = BASE[:32]
        old = shared + [1] * 17  # blocks: shared(2) + old tail(1)
        new = shared + [2] * 17
        cached_tokens(llm, old)
        cached_tokens(llm, new)
        assert llm.stats()["cached_blocks"] == 4
        # A 5-block request needs one eviction beyond the free blocks: the old tail goes first.
        cached_tokens(llm, [9] * 70)
        assert cached_tokens(llm, new) == 48, kind  # most recent branch survived
        assert cached_tokens(llm, shared + [1] * 17) == 32, kind  # shared interior survived its leaf
        assert_pool_drained(llm.engine)


def test_request_never_evicts_its_own_match(tiny_model_dir):
    for kind in ("radix", "hash"):
        llm = LLM(str(tiny_model_dir), progress=False, num_blocks=6, block_size=16, prefix_cache=kind)
        cached_tokens(llm, BASE[:49])  # 3 blocks cached, the least recently used ones
        cached_tokens(llm, [7] * 33)  # 2 more cached: 5 cached, 1 free
        # Needs its 3 matched blocks plus 2 new ones: one must come from evicting a block it did not match.
        out = llm.generate([BASE[:48] + [5] * 20], GREEDY)[0]
        assert out.num_cached_tokens == 48, kind
        assert llm.stats()["evictions"] >= 1, kind
        assert_pool_drained(llm.engine)


def test_request_that_cannot_fit_changes_nothing(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=6, block_size=16, prefix_cache="radix")
    cached_tokens(llm, BASE[:49])
    before = (list(llm.engine.block_manager.allocator.ref_counts), llm.stats())
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([BASE[:48] + [5] * 60], SamplingParams(max_tokens=10))
    assert (list(llm.engine.block_manager.allocator.ref_counts), llm.stats()) == before


def test_preempted_rematch_counted_apart(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=10, block_size=16, prefix_cache="radix")
    prompts = random_prompts(6, 40, 60, seed=3)
    llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_preempted_queries"] > 0
    assert stats["prefix_cache_queries"] == sum(len(p) for p in prompts)
    assert stats["prefix_cache_hits"] == 0  # distinct random prompts: no genuine hit


def test_lpm_admits_longest_cached_prefix_first(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=64, prefix_cache="radix",
              schedule_policy="lpm", max_num_seqs=1)
    cached_tokens(llm, BASE[:60])
    engine = llm.engine
    cold = engine.add_request(list(range(300, 350)), GREEDY)
    warm = engine.add_request(BASE[:60] + [1], GREEDY)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == [warm]
    while engine.has_unfinished_requests():
        engine.step()
    assert cold not in engine.requests


# --- outputs never depend on cache state ------------------------------------------------------------

SYSTEM = random_prompts(1, 70, 70, seed=11)[0]
QUESTIONS = random_prompts(6, 5, 25, seed=12)
DOCS = random_prompts(3, 33, 40, seed=13)


def shared_prefix_workloads() -> list[list[int]]:
    system_prompt = [SYSTEM + q for q in QUESTIONS]
    rag = [DOCS[a] + DOCS[b] + QUESTIONS[i] for i, (a, b) in enumerate([(0, 1), (1, 0), (2, 0), (0, 2)])]
    return system_prompt + rag


@pytest.fixture(scope="module")
def shared_reference(tiny_hf_model) -> list[list[int]]:
    return [hf_greedy(tiny_hf_model, p, 12) for p in shared_prefix_workloads()]


@pytest.mark.parametrize("prefix_cache", ["radix", "hash", "off"])
@pytest.mark.parametrize("num_blocks", [256, 14])
def test_outputs_unchanged_by_caching(tiny_model_dir, shared_reference, prefix_cache, num_blocks):
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=num_blocks, prefix_cache=prefix_cache)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = shared_prefix_workloads()
    first = llm.generate(prompts, params)  # concurrent: requests share blocks as they are published
    again = [llm.generate([p], params)[0] for p in prompts]  # one by one: hits on earlier work
    assert [o.token_ids for o in first] == shared_reference
    assert [o.token_ids for o in again] == shared_reference
    if prefix_cache != "off" and num_blocks == 256:
        assert sum(o.num_cached_tokens for o in again) > 0
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize("prefix_cache", ["radix", "hash"])
@pytest.mark.parametrize("eviction", [p for p in ONLINE_POLICIES if p != DEFAULT_EVICTION])  # default: above
def test_outputs_unchanged_under_every_eviction_policy(tiny_model_dir, shared_reference, prefix_cache, eviction):
    """A pool of 14 blocks evicts constantly: whichever blocks a policy drops, outputs stay exact."""
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=14, prefix_cache=prefix_cache, eviction=eviction)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = shared_prefix_workloads()
    assert [o.token_ids for o in llm.generate(prompts, params)] == shared_reference
    assert [llm.generate([p], params)[0].token_ids for p in prompts] == shared_reference
    assert llm.stats()["evictions"] > 0
    assert_pool_drained(llm.engine)


def test_multi_turn_conversation_matches_hf(tiny_model_dir, tiny_hf_model):
    llms = {kind: LLM(str(tiny_model_dir), progress=False, num_blocks=20, prefix_cache=kind)
            for kind in ("radix", "hash", "off")}
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    history = list(SYSTEM)
    for turn, question in enumerate(QUESTIONS[:4]):
        history = history + question
        expected = hf_greedy(tiny_hf_model, history, 10)
        for kind, llm in llms.items():
            out = llm.generate([history], params)[0]
            assert out.token_ids == expected, (kind, turn)
            if kind != "off" and turn > 0:
                assert out.num_cached_tokens > 0
        history = history + expected
    for llm in llms.values():
        assert_pool_drained(llm.engine)


def test_request_admitted_alongside_adopts_blocks_cached_meanwhile(llm, tiny_hf_model):
    engine = llm.engine
    engine.scheduler.prefix_hold = None  # B would wait for A's blocks instead (tests/test_prefix_hold.py)
    engine.scheduler.max_num_batched_tokens = 116  # step 1: A's whole 100-token prompt, and 16 of B's
    engine.scheduler.long_prefill_token_threshold = 0  # (no 64-token chunks beside each other)
    prompt = list(range(200, 300))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = engine.make_request(prompt, params)
    second = engine.make_request(prompt, params)
    engine.add(first)
    engine.add(second)
    engine.step()  # both admitted with nothing cached; A publishes 6 full blocks, B its first one
    assert second.num_cached_tokens == 0 and second.num_computed_tokens == 16
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    # At its block boundary B adopted A's blocks 1-5 instead of computing them again.
    assert second.num_cached_tokens == 80
    expected = hf_greedy(tiny_hf_model, prompt, 6)
    assert outputs[first.request_id].token_ids == expected == outputs[second.request_id].token_ids
    assert_pool_drained(engine)
