"""Engine behaviour on a tiny random Llama: sampling, stop conditions, streaming, aborts, bad input."""

from __future__ import annotations

import pytest

from conftest import TINY_VOCAB, assert_pool_drained, random_prompts
from kvserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), progress=False, num_blocks=64, max_model_len=512)


@pytest.fixture(autouse=True)
def drained(llm):
    yield
    assert_pool_drained(llm.engine)


PROMPTS = random_prompts(6, 5, 40, seed=7)


def sampled(temperature=1.0, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 12)
    return SamplingParams(temperature=temperature, ignore_eos=True, **kwargs)


def test_seed_reproducible_whatever_the_batch(llm):
    alone = llm.generate([PROMPTS[0]], sampled(seed=123))[0].token_ids
    crowd = llm.generate(PROMPTS, [sampled(seed=123)] + [sampled(seed=i) for i in range(len(PROMPTS) - 1)])
    assert crowd[0].token_ids == alone
    other_seed = llm.generate([PROMPTS[0]], sampled(seed=124))[0].token_ids
    assert other_seed != alone


def test_unseeded_sampling_varies(llm):
    outputs = [llm.generate([PROMPTS[1]], sampled(max_tokens=16))[0].token_ids for _ in range(3)]
    assert len({tuple(o) for o in outputs}) > 1


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate([PROMPTS[2]], sampled(temperature=0.0))[0].token_ids
    top1 = llm.generate([PROMPTS[2]], sampled(top_k=1, seed=5))[0].token_ids
    assert top1 == greedy


def test_tiny_top_p_is_greedy(llm):
    greedy = llm.generate([PROMPTS[3]], sampled(temperature=0.0))[0].token_ids
    nucleus = llm.generate([PROMPTS[3]], sampled(top_p=1e-6, seed=5))[0].token_ids
    assert nucleus == greedy


def test_min_p_one_is_greedy(llm):
    greedy = llm.generate([PROMPTS[4]], sampled(temperature=0.0))[0].token_ids
    assert llm.generate([PROMPTS[4]], sampled(min_p=1.0, seed=9))[0].token_ids == greedy


def test_top_k_restricts_to_top_tokens(llm):
    out = llm.generate([PROMPTS[0]], sampled(max_tokens=1, top_k=3, seed=1, logprobs=3))[0]
    top_ids = [token for token, _ in out.logprobs[0].top]
    assert out.token_ids[0] in top_ids


def test_max_tokens_and_finish_reason(llm):
    out = llm.generate([PROMPTS[0]], sampled(temperature=0.0, max_tokens=5))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_ids(llm):
    greedy = llm.generate([PROMPTS[1]], sampled(temperature=0.0, max_tokens=10))[0].token_ids
    stop_at = greedy[4]
    out = llm.generate([PROMPTS[1]], sampled(temperature=0.0, max_tokens=10, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == greedy[: greedy.index(stop_at) + 1]
    assert out.finish_reason == "stop"


def test_eos_stops_unless_ignored(llm):
    eos = llm.engine.model_config.eos_token_id
    greedy = llm.generate([PROMPTS[2]], sampled(temperature=0.0, max_tokens=10))[0].token_ids
    llm.engine.eos_token_ids = frozenset([greedy[2]])
    try:
        for request_eos in (True, False):
            params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=request_eos)
            out = llm.generate([PROMPTS[2]], params)[0]
            assert (out.token_ids == greedy) is request_eos
        assert out.token_ids == greedy[: greedy.index(greedy[2]) + 1] and out.finish_reason == "stop"
    finally:
        llm.engine.eos_token_ids = frozenset([eos])


def test_logprobs_are_consistent(llm):
    out = llm.generate([PROMPTS[3]], sampled(temperature=0.0, max_tokens=4, logprobs=5))[0]
    assert len(out.logprobs) == 4
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry.token_id == token_id
        assert entry.logprob <= 0
        assert entry.top[0][0] == token_id  # greedy: the sampled token is the most likely
        assert entry.top[0][1] == pytest.approx(entry.logprob)
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)


def test_stream_yields_every_token_and_matches_generate(llm):
    params = sampled(temperature=0.0, max_tokens=8)
    expected = llm.generate([PROMPTS[4]], params)[0].token_ids
    streamed = [tok for out in llm.stream(PROMPTS[4], params) for tok in out.delta_token_ids]
    assert streamed == expected


def test_closing_a_stream_aborts_and_frees(llm):
    stream = llm.stream(PROMPTS[5], sampled(temperature=0.0, max_tokens=50))
    next(stream)
    assert llm.stats()["used_blocks"] > 0
    stream.close()  # the drained fixture checks every block came back


def test_abort_running_and_waiting(llm):
    engine = llm.engine
    ids = [engine.add_request(p, sampled(max_tokens=30)) for p in PROMPTS]
    engine.step()
    engine.step()
    for request_id in ids:
        out = engine.abort_request(request_id)
        assert out.finished and out.finish_reason == "abort"
    assert engine.abort_request("no-such-request") is None


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([1, 2, TINY_VOCAB], SamplingParams(), "outside the vocabulary"),
        ([1, -1], SamplingParams(), "outside the vocabulary"),
        ([1] * 500, SamplingParams(max_tokens=20), "max_model_len"),
        ("text prompt", SamplingParams(), "tokenizer"),
    ],
)
def test_bad_prompts_rejected_before_allocation(llm, prompt, params, message):
    before = llm.stats()
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params)
    after = llm.stats()
    assert after["used_blocks"] == before["used_blocks"] and after["num_waiting"] == 0


def test_request_bigger_than_pool_rejected(tiny_model_dir):
    small = LLM(str(tiny_model_dir), progress=False, num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([[5] * 60], SamplingParams(max_tokens=10))
    assert small.generate([[5] * 40], SamplingParams(max_tokens=10, temperature=0))[0].token_ids
    assert_pool_drained(small.engine)


def test_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], []], SamplingParams())
    assert llm.stats()["num_waiting"] == 0 and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_invalid_sampling_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_engine_usable_after_errors(llm):
    with pytest.raises(ValueError):
        llm.generate([[]], SamplingParams())
    assert len(llm.generate([PROMPTS[0]], sampled(temperature=0.0, max_tokens=3))[0].token_ids) == 3


@pytest.mark.parametrize("bad_model", ["no-such-model", "/nonexistent/path.gguf"])
def test_unknown_model(bad_model):
    with pytest.raises(ValueError):
        LLM(bad_model, progress=False)


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_size", 3), ("block_size", 512), ("dtype", "int4"), ("prefix_cache", "lru"),
     ("kv_cache_memory", "lots"), ("max_num_seqs", 0), ("schedule_policy", "random")],
)
def test_invalid_engine_config(tiny_model_dir, field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        LLM(str(tiny_model_dir), progress=False, **{field: value})
