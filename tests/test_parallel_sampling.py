"""Parallel sampling (n / best_of): one prefill, shared prompt blocks, per-child seeds, stops and aborts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import assert_pool_drained, hf_greedy, random_prompts
from kvserve import LLM, SamplingParams

PROMPT_1000 = random_prompts(1, 1000, 1000, seed=7)[0]  # 62 full blocks of 16 + a tail of 8 tokens


def make_llm(model_dir, **engine_args) -> LLM:
    engine_args.setdefault("num_blocks", 256)
    return LLM(str(model_dir), progress=False, **engine_args)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(3, 20, 70, seed=4)


def sampled(seed: int, **overrides) -> SamplingParams:
    settings = dict(max_tokens=12, temperature=0.9, seed=seed, ignore_eos=True) | overrides
    return SamplingParams(**settings)


@pytest.mark.parametrize("prefix_cache", ["radix", "off"])
def test_greedy_children_equal_the_single_greedy_output(tiny_model_dir, tiny_hf_model, prompts, prefix_cache):
    llm = make_llm(tiny_model_dir, prefix_cache=prefix_cache)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, n=4))
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(tiny_hf_model, prompt, 16)
        assert [c.token_ids for c in output.outputs] == [expected] * 4
        assert output.token_ids == expected and output.finish_reason == "length"
        assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert_pool_drained(llm.engine)


def test_child_i_draws_what_a_lone_request_with_seed_plus_i_draws(tiny_model_dir, prompts):
    llm = make_llm(tiny_model_dir)
    first = llm.generate(prompts[0], sampled(123, n=4))[0]
    again = llm.generate(prompts[0], sampled(123, n=4))[0]
    lone = llm.generate([prompts[0]] * 4, [sampled(123 + i) for i in range(4)])
    children = [c.token_ids for c in first.outputs]
    assert children == [c.token_ids for c in again.outputs]  # reproducible
    assert children == [o.token_ids for o in lone]
    assert len({tuple(c) for c in children}) > 1  # the seeds really differ
    assert_pool_drained(llm.engine)


def test_best_of_keeps_the_n_best_by_cumulative_logprob(tiny_model_dir, prompts):
    llm = make_llm(tiny_model_dir)
    output = llm.generate(prompts[1], sampled(9, n=2, best_of=6, temperature=1.2))[0]
    lone = llm.generate([prompts[1]] * 6, [sampled(9 + i, temperature=1.2, logprobs=0) for i in range(6)])
    totals = [sum(entry.logprob for entry in o.logprobs) for o in lone]
    ranked = sorted(range(6), key=lambda i: totals[i], reverse=True)[:2]
    assert [c.token_ids for c in output.outputs] == [lone[i].token_ids for i in ranked]
    for completion, i in zip(output.outputs, ranked, strict=True):
        assert completion.cumulative_logprob == pytest.approx(totals[i], abs=1e-4)
    assert output.outputs[0].cumulative_logprob >= output.outputs[1].cumulative_logprob
    assert_pool_drained(llm.engine)


def test_stop_conditions_apply_to_each_child(tiny_model_dir, prompts):
    llm = make_llm(tiny_model_dir)
    stops = dict(temperature=1.5, max_tokens=24, stop_token_ids=list(range(3, 20)))
    output = llm.generate(prompts[2], sampled(77, n=6, **stops))[0]
    lone = llm.generate([prompts[2]] * 6, [sampled(77 + i, **stops) for i in range(6)])
    assert [(c.token_ids, c.finish_reason) for c in output.outputs] == [
        (o.token_ids, o.finish_reason) for o in lone
    ]
    assert {c.finish_reason for c in output.outputs} == {"stop", "length"}  # both kinds occurred
    assert_pool_drained(llm.engine)


def test_stream_deltas_add_up_per_child(tiny_model_dir, prompts):
    llm = make_llm(tiny_model_dir)
    streamed: dict[int, list[int]] = {}
    for output in llm.stream(prompts[0], sampled(5, n=3)):
        for completion in output.outputs:
            streamed.setdefault(completion.index, []).extend(completion.delta_token_ids)
    assert output.finished and streamed == {c.index: c.token_ids for c in output.outputs}
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize("prefix_cache", ["radix", "off"])
def test_n8_holds_the_prompt_blocks_once(tiny_model_dir, prefix_cache):
    """1,000-token prompt: 63 blocks (62 full + a tail of 8). n=8 with 8 output tokens writes 7 tokens,
    all inside the tail block, so the only extra blocks are the tail copies: 7, since the last child
    still sharing the tail writes it in place. Independent requests hold 8 x 63."""
    prompt_blocks = 63
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)
    shared = make_llm(tiny_model_dir, num_blocks=600, prefix_cache=prefix_cache)
    shared.generate(PROMPT_1000, replace(params, n=8))
    independent = make_llm(tiny_model_dir, num_blocks=600, prefix_cache="off", max_num_batched_tokens=8192)
    independent.generate([PROMPT_1000] * 8, [params] * 8)
    assert shared.stats()["peak_used_blocks"] == prompt_blocks + 7
    assert independent.stats()["peak_used_blocks"] == 8 * prompt_blocks
    assert_pool_drained(shared.engine)
    assert_pool_drained(independent.engine)


def test_prefix_cache_registers_shared_blocks_once(tiny_model_dir, prompts):
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    single, parallel = make_llm(tiny_model_dir), make_llm(tiny_model_dir)
    single.generate(prompts[1], greedy)
    parallel.generate(prompts[1], replace(greedy, n=4))
    # Identical children publish identical blocks: the cache keeps one copy, as for a single request.
    assert parallel.stats()["registered_blocks"] == single.stats()["registered_blocks"]
    assert parallel.stats()["prefix_cache_queries"] == len(prompts[1])  # the prompt was matched once


@pytest.mark.parametrize("prefix_cache", ["radix", "hash", "off"])
def test_abort_midway_leaves_the_pool_drained(tiny_model_dir, prompts, prefix_cache):
    llm = make_llm(tiny_model_dir, prefix_cache=prefix_cache)
    engine = llm.engine
    request_id = engine.add_request(prompts[1] * 3, sampled(3, n=8, max_tokens=40))
    other = engine.add_request(prompts[0], sampled(4, max_tokens=30))
    for _ in range(6):
        engine.step()
    assert len(engine.scheduler.running) == 9  # eight children and the plain request
    output = engine.abort_request(request_id)
    assert output.finished and output.finish_reason == "abort" and len(output.outputs) == 8
    assert all(c.finish_reason == "abort" and c.token_ids for c in output.outputs)
    assert engine.abort_request(request_id) is None
    while engine.has_unfinished_requests():
        engine.step()
    assert other not in engine.requests
    assert_pool_drained(engine)


@pytest.mark.parametrize("prefix_cache", ["radix", "hash", "off"])
def test_preempted_children_still_equal_greedy(tiny_model_dir, tiny_hf_model, prompts, prefix_cache):
    # 9 blocks of 16: one child needs up to 6 (a 70-token prompt + 24), four at once do not fit.
    llm = make_llm(tiny_model_dir, num_blocks=9, prefix_cache=prefix_cache)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=4)
    outputs = llm.generate(prompts, greedy)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert [c.token_ids for c in output.outputs] == [hf_greedy(tiny_hf_model, prompt, 24)] * 4
    assert llm.stats()["num_preemptions"] > 0
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize("fields", [dict(n=0), dict(n=2, best_of=1), dict(n=1.5)])
def test_invalid_n_or_best_of_is_rejected(fields):
    with pytest.raises(ValueError, match="n must|best_of must"):
        SamplingParams(**fields)
