"""Speculative decoding by prompt lookup (engine/speculative.py): drafts change how many steps a request
takes, never what it outputs -- greedy equals transformers, seeded sampling equals plain decoding, stops
land where they would, and the pool accounting holds under random operations."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import assert_pool_drained, hf_greedy, random_prompts
from kvserve import LLM, SamplingParams
from kvserve.cli import add_engine_flags, engine_config_from_args
from kvserve.config import EngineConfig
from kvserve.engine.request import Request
from kvserve.engine.speculative import (
    SpeculativeConfig,
    Speculator,
    back_off,
    parse_speculative_config,
    propose_ngram,
)
from kvserve.server.metrics import EngineStatsCollector
from test_engine_pool_properties import apply_step_or_abort, check_pool, drain_checking, operation
from test_server_support import chat_model_dir, metric_value, start_server  # noqa: F401

MAX_NEW = 32
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
IN_BATCHES = {"disable_by_batch_size": 64}  # drafts in every step however many run: the mixed batches under test


def repeating_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase: lookups find drafts, and a random model sometimes follows them."""
    phrases = random_prompts(count, 3, 8, seed=seed)
    return [(phrase * 12)[: 40 + 7 * i] for i, phrase in enumerate(phrases)]


def make_llm(model_dir, **engine_args) -> LLM:
    engine_args.setdefault("num_blocks", 256)
    return LLM(str(model_dir), progress=False, **engine_args)


# --- the proposer ------------------------------------------------------------------------------------------


def test_the_longest_tail_match_wins_and_its_latest_occurrence():
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 1, 2, 9, 9, 3, 1, 2, 7, 8, 2]
    assert propose_ngram(tokens, config, 3) == [7, 8, 2]  # "2" last seen at 7 (longer tails do not match)
    tokens = [4, 1, 2, 6, 6, 6, 7, 1, 2, 8, 8, 1, 2]
    assert propose_ngram(tokens, config, 3) == [8, 8, 1]  # "1 2": latest earlier occurrence at 7
    tokens = [1, 2, 3, 4, 0, 2, 3, 9, 1, 2, 3]
    assert propose_ngram(tokens, config, 3) == [4, 0, 2]  # "1 2 3" (3 tokens) beats "2 3" (at 5)
    assert propose_ngram(tokens, config, 1) == [4]
    assert propose_ngram(tokens, config, 0) == []
    assert propose_ngram([1, 2, 3, 4], config, 3) == []  # no earlier occurrence of any tail
    assert propose_ngram([7, 7, 7], config, 3) == [7]  # the tail overlapping itself: what follows, up to now
    assert propose_ngram([7] * 8, config, 3) == [7, 7, 7]  # an occurrence followed by all 3 beats the latest
    assert propose_ngram([5, 1, 2, 8, 9, 6, 1, 2], config, 3) == [8, 9, 6]  # "1 2" at 1 has 3 followers, at 6 none
    strict = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=4, prompt_lookup_min=2)
    assert propose_ngram([1, 2, 3, 4, 0, 9, 4], strict, 2) == []  # only 1-token matches: below the minimum


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=0, max_size=40), k=st.integers(1, 5),
       low=st.integers(1, 3), extra=st.integers(0, 2), limit=st.integers(0, 6))
def test_a_draft_is_what_followed_a_match_of_the_tail(tokens, k, low, extra, limit):
    config = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=low + extra, prompt_lookup_min=low)
    draft = propose_ngram(tokens, config, limit)
    assert len(draft) <= min(k, limit)
    if not draft:
        return
    found = False
    for n in range(low, low + extra + 1):  # some n-gram tail occurred earlier and the draft followed it
        tail = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == tail and tokens[start + n : start + n + len(draft)] == draft:
                found = True
    assert found


def test_one_lookup_bound_given_sets_the_other_as_vllm_does():
    assert parse_speculative_config('{"prompt_lookup_max": 2}').prompt_lookup_min == 2
    default_min = SpeculativeConfig().prompt_lookup_min
    assert parse_speculative_config('{"prompt_lookup_max": 6}').prompt_lookup_min == default_min
    assert parse_speculative_config('{"prompt_lookup_min": 6}').prompt_lookup_max == 6
    assert parse_speculative_config("{}") == SpeculativeConfig()


def test_drafts_that_miss_back_off_and_a_hit_resumes_them():
    request = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=100), speculate=True)
    request.num_computed_tokens = request.num_tokens - 1
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1), max_model_len=64)
    assert speculator.draft(request, budget=8, num_running=3) == []  # more than disable_by_batch_size run
    assert speculator.draft(request, budget=8, num_running=2) == [3, 1]
    waits = []
    for _ in range(6):  # every draft misses: 1, 2, 4, 8, 16, 16 outputs decoded plainly before the next
        back_off(request, matched=0)
        waits.append(request.drafts_resume_at - request.num_output_tokens)
    assert waits == [1, 2, 4, 8, 16, 16]
    assert speculator.draft(request, budget=8, num_running=1) == []
    for token in [3] * 16:
        request.append_token(token)
    request.num_computed_tokens = request.num_tokens - 1
    assert speculator.draft(request, budget=8, num_running=1) == [3, 3]  # resumed
    back_off(request, matched=1)
    assert request.draft_backoff == 0


def test_configs_are_checked_and_named():
    assert parse_speculative_config(None) is None
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}').num_speculative_tokens == 2
    for bad, words in (('{"method": "eagle"}', "no draft models"), ('{"num_speculative_tokens": 0}', "1..16"),
                       ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
                       ('{"model": "x"}', "unknown keys"), ("[1]", "JSON object"), ("{", "not JSON"),
                       ('{"num_speculative_tokens": "3"}', "integer"),
                       ('{"disable_by_batch_size": 0}', "disable_by_batch_size")):
        with pytest.raises(ValueError, match=words):
            EngineConfig(speculative_config=bad)
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 5}'])
    assert parse_speculative_config(engine_config_from_args(args).speculative_config).prompt_lookup_max == 5


# --- the engine ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return repeating_prompts(16, seed=3) + random_prompts(8, 5, 40, seed=4)


@pytest.fixture(scope="module")
def reference(tiny_hf_model, prompts) -> list[list[int]]:
    return [hf_greedy(tiny_hf_model, prompt, MAX_NEW) for prompt in prompts]


@pytest.mark.parametrize(("prefix_cache", "num_speculative_tokens"),
                         [("radix", 1), ("radix", 3), ("radix", 6), ("hash", 3), ("off", 3)])
def test_greedy_equals_transformers(tiny_model_dir, prompts, reference, prefix_cache, num_speculative_tokens):
    llm = make_llm(tiny_model_dir, prefix_cache=prefix_cache,
                   speculative_config={"num_speculative_tokens": num_speculative_tokens, **IN_BATCHES})
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference  # batched
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts[:4]] == reference[:4]  # alone
    stats = llm.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # drafts kept and drafts refused
    assert_pool_drained(llm.engine)


def test_chunked_prefill_and_preemption_keep_the_tokens(tiny_model_dir, prompts, reference):
    llm = make_llm(tiny_model_dir, num_blocks=12, max_num_batched_tokens=24, speculative_config=IN_BATCHES)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["spec_accepted_tokens"] > 0
    assert_pool_drained(llm.engine)


def test_sampling_logprobs_and_stops_equal_plain_decoding(tiny_model_dir, prompts):
    """Each row is sampled as a plain step would be, with the request's own generator: seeded sampling,
    log-probs, penalties, stop ids and max_tokens land exactly where they would without drafts."""
    plain = make_llm(tiny_model_dir)
    config = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, **IN_BATCHES}
    spec = make_llm(tiny_model_dir, speculative_config=config)
    greedy_plain = plain.generate(prompts, GREEDY)
    stop_ids = [o.token_ids[5] for o in greedy_plain]  # each stops at its 6th token (or earlier)
    cases = [
        [SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=11 + i, ignore_eos=True, logprobs=2)
         for i in range(len(prompts))],
        [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop], ignore_eos=True)
         for stop in stop_ids],
        [SamplingParams(max_tokens=1 + i, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                        min_tokens=1) for i in range(len(prompts))],
    ]
    for params in cases:
        expected, got = plain.generate(prompts, params), spec.generate(prompts, params)
        for a, b in zip(expected, got, strict=True):
            assert (a.token_ids, a.finish_reason, a.outputs[0].stop_reason) == (
                b.token_ids, b.finish_reason, b.outputs[0].stop_reason)
            if a.logprobs is not None:
                assert [(e.token_id, e.rank) for e in a.logprobs] == [(e.token_id, e.rank) for e in b.logprobs]
                assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-4)
    assert spec.stats()["spec_accepted_tokens"] > 0
    assert_pool_drained(spec.engine)


def test_groups_decode_without_drafts(tiny_model_dir):
    """n > 1 samples and beams do not speculate; plain requests beside them do."""
    llm = make_llm(tiny_model_dir, speculative_config={})
    prompt = repeating_prompts(1, seed=9)[0]
    outputs = llm.generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=0.9, seed=1, ignore_eos=True))
    assert len(outputs[0].outputs) == 3
    assert llm.stats()["spec_drafts"] == 0
    assert_pool_drained(llm.engine)


def test_the_server_exports_vllms_spec_decode_counters():
    stats = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "num_blocks": 8, "prefix_cache_queries": 0,
             "prefix_cache_hits": 0, "num_preemptions": 0, "evictions": 0, "free_blocks": 8, "cached_blocks": 0,
             "used_blocks": 0, "spec_drafts": 3, "spec_draft_tokens": 9, "spec_accepted_tokens": 4}
    names = {metric.name: metric.samples[0].value for metric in EngineStatsCollector(lambda: stats, "m").collect()
             if metric.samples}
    assert names["kvserve_spec_decode_num_draft_tokens"] == 9
    assert names["kvserve_spec_decode_num_accepted_tokens"] == 4


@pytest.fixture(scope="module")
def spec_engine(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=10, block_size=16, max_num_batched_tokens=40,
              speculative_config={"num_speculative_tokens": 5, "prompt_lookup_max": 3, **IN_BATCHES})
    return llm.engine


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(operation, min_size=1, max_size=30), seed=st.integers(0, 2**16))
def test_random_operations_with_drafts_keep_the_pool_consistent(spec_engine, ops, seed):
    ids: list[str] = []
    phrase = [seed % 11 + 3, seed % 13 + 20, 7]
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, shared, *_ = op
            prompt = ((phrase * 30) if shared else [(seed + 3 * i) % 40 + 3 for i in range(70)])[:length]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            ids.append(spec_engine.add_request(prompt[: 150 - max_tokens], params))
        else:
            apply_step_or_abort(spec_engine, op, ids)
        check_pool(spec_engine)
    drain_checking(spec_engine, check_pool)


def test_serve_takes_the_flag_and_answers_as_offline_decoding(chat_model_dir):  # noqa: F811
    """`kvserve serve --speculative-config JSON`: a completion equals plain offline decoding of the same
    model, and /metrics counts the drafts."""
    prompt = [token % 300 + 10 for token in repeating_prompts(1, seed=13)[0]]  # within the chat model's vocabulary
    expected = LLM(str(chat_model_dir), progress=False, num_blocks=64).generate([prompt], GREEDY)[0].text
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    with start_server(chat_model_dir, "--speculative-config", config) as server:
        body = {"model": "tiny-chat", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected
        assert metric_value(server.url, "kvserve_spec_decode_num_drafts_total") > 0


def test_drafts_take_free_blocks_only_never_a_cached_one(tiny_model_dir):
    llm = make_llm(tiny_model_dir, num_blocks=8, prefix_cache="radix")
    llm.generate([list(range(3, 67)), list(range(100, 164))], SamplingParams(max_tokens=1, temperature=0.0))
    manager = llm.engine.block_manager
    assert manager.allocator.num_free == 0 and manager.prefix_cache.num_evictable_blocks == 8  # all cached
    request = llm.engine.make_request(list(range(200, 210)), GREEDY)
    assert manager.can_grow(request, 10)  # a plain step may evict a cached block ...
    assert not manager.can_grow_from_free(request, 10)  # ... a drafted one may not


def test_structured_output_with_drafts_equals_plain_decoding(chat_model_dir):  # noqa: F811
    """A grammar masks each drafted row in the state its earlier rows left (the matcher advances as tokens
    are appended), so constrained outputs do not move either."""
    from kvserve import StructuredOutputsParams

    plain = LLM(str(chat_model_dir), progress=False, num_blocks=128)
    spec = LLM(str(chat_model_dir), progress=False, num_blocks=128,
               speculative_config={"num_speculative_tokens": 4, "prompt_lookup_min": 1, **IN_BATCHES})
    prompts = ["ab ab ab cd cd", "yes yes yes yes", '{"a": "b"} {"a": "b"}']
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    for constraint in (StructuredOutputsParams(regex="(ab|cd){3,8}"), StructuredOutputsParams(json=schema),
                       StructuredOutputsParams(choice=["yes yes yes", "no no no no"])):
        params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=constraint)
        assert [o.token_ids for o in spec.generate(prompts, params)] == [
            o.token_ids for o in plain.generate(prompts, params)]
    assert spec.stats()["spec_accepted_tokens"] > 0
    assert_pool_drained(spec.engine)


def test_lora_rows_with_drafts_equal_plain_decoding(tiny_model_dir, tmp_path, prompts):
    """Every drafted row of a request runs under its adapter (a mixed batch: one adapter, another, none)."""
    from kvserve.lora.adapter import LoRARequest
    from lora_util import make_peft_adapter

    adapters = [LoRARequest(name, index + 1, str(make_peft_adapter(tiny_model_dir, tmp_path / name, seed=index + 1,
                                                                   rank=4)))
                for index, name in enumerate(("a", "b"))]
    chosen = [adapters[0], adapters[1], None] * 2
    engine_args = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 4}
    plain = make_llm(tiny_model_dir, **engine_args)
    spec = make_llm(tiny_model_dir, speculative_config={"prompt_lookup_min": 1, **IN_BATCHES}, **engine_args)
    batch = prompts[:6]
    expected = [o.token_ids for o in plain.generate(batch, GREEDY, lora_request=chosen)]
    assert [o.token_ids for o in spec.generate(batch, GREEDY, lora_request=chosen)] == expected
    assert spec.stats()["spec_accepted_tokens"] > 0
    assert_pool_drained(spec.engine)
