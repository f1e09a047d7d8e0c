"""In-batch prefix sharing (the admission hold-back) and cascade decode attention through the engine.

Tiny random Llama, fp32: greedy outputs equal transformers with both features on, for radix and hash
caches and both kernel backends; a request held back for a running request's prefix gets it as a
cache hit; a hold is bounded (never starved); tenants (namespaces) are never held on each other; and
prompts that share nothing are never held. The suite's KVSERVE_DEBUG_CHECKS=1 checks the pool, the
cache and every block table after each step.
"""

from __future__ import annotations

import pytest

from conftest import assert_pool_drained, hf_greedy
from kvserve import LLM, SamplingParams
from kvserve.engine.prefix_admission import PrefixHold
from kvserve.engine.request import RequestStatus
from kvserve.kernels.ops import Kernels

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
PREFIX_A = list(range(100, 180))  # 80 tokens: 5 blocks of 16
PREFIX_B = list(range(300, 370))  # 70 tokens: 4 full blocks


def make_llm(model_dir, **engine_args) -> LLM:
    engine_args.setdefault("num_blocks", 128)
    return LLM(str(model_dir), progress=False, **engine_args)


def shared_prompts() -> list[list[int]]:
    """Two families of prompts sharing long prefixes, and two that share nothing."""
    prompts = [PREFIX_A + [5 + i, 7 + i, 9] for i in range(4)] + [PREFIX_B + [11 + i] * (i + 1) for i in range(3)]
    return prompts + [list(range(400, 430)), list(range(200, 237))]


@pytest.fixture(scope="module")
def reference(tiny_hf_model) -> list[list[int]]:
    return [hf_greedy(tiny_hf_model, prompt, MAX_NEW) for prompt in shared_prompts()]


def run_all(llm: LLM, prompts: list[list[int]], salts: list[str | None] | None = None) -> list:
    """Add every prompt at once, then step to the end; returns the engine requests in order."""
    engine = llm.engine
    salts = salts or [None] * len(prompts)
    requests = []
    for prompt, salt in zip(prompts, salts, strict=True):
        namespace = () if salt is None else (salt,)
        request = engine.make_request(prompt, GREEDY, namespace=namespace)
        engine.add(request)
        requests.append(request)
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_drained(engine)
    return requests


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("prefix_cache", ["radix", "hash"])
def test_outputs_equal_transformers_with_hold_and_cascade(tiny_model_dir, reference, prefix_cache, kernels,
                                                           monkeypatch):
    calls = []
    original = Kernels.cascade_attention
    monkeypatch.setattr(Kernels, "cascade_attention", lambda self, *a: calls.append(1) or original(self, *a))
    llm = make_llm(tiny_model_dir, prefix_cache=prefix_cache, kernels=kernels)
    requests = run_all(llm, shared_prompts())
    assert [r.output_token_ids for r in requests] == reference
    assert calls, "no decode step used cascade attention"
    # Every follower of a family took its leader's prefix from the cache instead of computing it.
    assert [r.num_cached_tokens for r in requests[:4]] == [0, 80, 80, 80]
    assert [r.num_cached_tokens for r in requests[4:7]] == [0, 64, 64]
    assert llm.engine.scheduler.prefix_hold.num_holds > 0


def test_features_off_recompute_the_prefix_and_agree(tiny_model_dir, reference, monkeypatch):
    calls = []
    monkeypatch.setattr(Kernels, "cascade_attention", lambda *a: calls.append(1))
    llm = make_llm(tiny_model_dir, disable_prefix_hold=True, disable_cascade_attn=True)
    assert llm.engine.scheduler.prefix_hold is None
    requests = run_all(llm, shared_prompts())
    assert [r.output_token_ids for r in requests] == reference
    assert not calls
    assert [r.num_cached_tokens for r in requests[:4]] == [0, 0, 0, 0]  # all admitted in one step: no hits


def test_cache_off_never_holds(tiny_model_dir):
    llm = make_llm(tiny_model_dir, prefix_cache="off")
    assert llm.engine.scheduler.prefix_hold is None  # nothing would ever be published to wait for


def test_held_request_is_admitted_with_the_hit_after_the_leader_publishes(tiny_model_dir):
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=32)  # the leader's 83 tokens take three steps
    engine = llm.engine
    leader = engine.make_request(PREFIX_A + [1, 2, 3], GREEDY)
    follower = engine.make_request(PREFIX_A + [4, 5, 6], GREEDY)
    engine.add(leader)
    engine.add(follower)
    engine.step()
    assert leader.status is RequestStatus.RUNNING and follower.status is RequestStatus.WAITING
    while follower.status is RequestStatus.WAITING:
        published_before = leader.num_published_blocks
        engine.step()
    assert published_before >= 5  # admitted only once the leader had registered every shared block
    assert follower.num_cached_tokens == 80  # all five shared blocks, none computed twice
    assert engine.scheduler.prefix_hold.num_holds >= 1
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_drained(engine)


def test_hold_is_bounded(tiny_model_dir):
    """A leader that prefills slowly (4-token chunks) holds a follower for at most max_hold_steps."""
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=64, long_prefill_token_threshold=4)
    engine = llm.engine
    engine.scheduler.prefix_hold = PrefixHold(block_size=16, max_hold_steps=3)
    leader = engine.make_request(PREFIX_A + [1], GREEDY)
    follower = engine.make_request(PREFIX_A + [2], GREEDY)
    engine.add(leader)
    engine.add(follower)
    steps = 0
    while follower.status is RequestStatus.WAITING:
        engine.step()
        steps += 1
        assert steps <= 4, "the follower was starved"  # held in steps 1-3, admitted in step 4
    assert leader.num_computed_tokens < len(PREFIX_A)  # released by the bound, not by the leader's prefill
    while engine.has_unfinished_requests():
        engine.step()
    assert len(follower.output_token_ids) == MAX_NEW and follower.finish_reason is not None
    assert_pool_drained(engine)


def test_tenants_are_never_held_on_each_other(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    requests = [engine.make_request(PREFIX_A + [i], GREEDY, namespace=(salt,)) for i, salt in
                enumerate(["alice", "bob", "carol", "alice"])]
    for request in requests:
        engine.add(request)
    engine.step()
    # Different tenants run at once, computing the prefix each; alice's second request waits for alice's first.
    assert [r.status for r in requests] == [RequestStatus.RUNNING] * 3 + [RequestStatus.WAITING]
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.num_cached_tokens for r in requests] == [0, 0, 0, 80]
    assert_pool_drained(engine)


def test_prompts_sharing_nothing_are_never_held(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    requests = [engine.make_request(list(range(10 + 40 * i, 50 + 40 * i)), GREEDY) for i in range(6)]
    for request in requests:
        engine.add(request)
    engine.step()
    assert all(r.status is RequestStatus.RUNNING for r in requests)  # admitted together, as without the hold
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.prefix_hold.num_holds == 0
    assert_pool_drained(engine)


def test_forked_samples_decode_through_cascade(tiny_model_dir, tiny_hf_model, monkeypatch):
    """n greedy samples share the prompt's blocks (forks): their decodes form one cascade group."""
    calls = []
    original = Kernels.cascade_attention
    monkeypatch.setattr(Kernels, "cascade_attention", lambda self, *a: calls.append(1) or original(self, *a))
    llm = make_llm(tiny_model_dir)
    prompt = PREFIX_A + [1, 2]
    output = llm.generate([prompt], SamplingParams(n=3, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))[0]
    expected = hf_greedy(tiny_hf_model, prompt, MAX_NEW)
    assert [c.token_ids for c in output.outputs] == [expected] * 3
    assert calls
    assert_pool_drained(llm.engine)
