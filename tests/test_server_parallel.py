"""Server end to end: n / best_of as one parallel engine request per prompt, and beam search
(`use_beam_search`) on /v1/completions, checked against the in-process engine on the same tiny model."""

from __future__ import annotations

import json
import random
import time

import httpx
import openai
import pytest

from kvserve import LLM
from test_server_support import chat_model_dir, metric_value, server, wait_until_drained  # noqa: F401

MODEL = "tiny-chat"
IGNORE_EOS = {"ignore_eos": True}
USED_BLOCKS = 'kvserve_kv_cache_blocks{state="used"}'
ABORTED = 'kvserve_request_success_total{finished_reason="abort"}'
BEAM_PROMPT = [random.Random(24).randrange(3, 300) for _ in range(24)]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(chat_model_dir) -> LLM:  # noqa: F811
    return LLM(str(chat_model_dir), progress=False, num_blocks=512)


def random_ids(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(count)]  # ids >= 3: no special tokens


def texts(response) -> list[str]:
    return [c.text for c in sorted(response.choices, key=lambda c: c.index)]


def counters(url: str) -> dict[str, float]:
    names = ("kvserve_prompt_tokens_total", "kvserve_prefix_cache_queries_total",
             'kvserve_request_success_total{finished_reason="length"}')
    return {name: metric_value(url, name, default=0.0) for name in names}


# --- n / best_of ------------------------------------------------------------------------------------------


def test_n_2_is_one_engine_request_prefilled_once(server, client):  # noqa: F811
    before = counters(server.url)
    response = client.completions.create(model=MODEL, prompt=random_ids(40, seed=21), n=2, max_tokens=6,
                                         temperature=1.0, seed=5, extra_body=IGNORE_EOS)
    after = counters(server.url)
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.prompt_tokens == 40 and response.usage.completion_tokens == 12
    delta = {name: after[name] - before[name] for name in after}
    assert delta == {
        "kvserve_prompt_tokens_total": 40,  # one engine request finished: its prompt counted once
        "kvserve_prefix_cache_queries_total": 40,  # admitted (looked up, prefilled) once, not per choice
        'kvserve_request_success_total{finished_reason="length"}': 1,
    }


def test_greedy_n_3_choices_are_identical(client):
    messages = [{"role": "user", "content": "same answer"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=IGNORE_EOS)
    single = client.chat.completions.create(**kwargs)
    triple = client.chat.completions.create(n=3, **kwargs)
    assert [c.index for c in triple.choices] == [0, 1, 2]
    assert [c.message.content for c in triple.choices] == [single.choices[0].message.content] * 3
    assert triple.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert triple.usage.completion_tokens == 24


def test_seeded_n_2_is_reproducible_and_choice_i_uses_seed_plus_i(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0,
                  extra_body=IGNORE_EOS)
    first = texts(client.completions.create(n=2, seed=77, **kwargs))
    assert first == texts(client.completions.create(n=2, seed=77, **kwargs))
    assert first[0] != first[1]
    assert first[1] == client.completions.create(seed=78, **kwargs).choices[0].text
    wrapped = texts(client.completions.create(n=2, seed=2**63 - 1, **kwargs))  # seeds wrap at 2**63
    assert wrapped[1] == client.completions.create(seed=0, **kwargs).choices[0].text


def test_best_of_returns_the_best_of_its_samples(client):
    kwargs = dict(model=MODEL, prompt=random_ids(20, seed=22), max_tokens=8, temperature=1.0, seed=9,
                  extra_body=IGNORE_EOS)
    samples = texts(client.completions.create(n=3, **kwargs))  # the same 3 seeds best_of=3 draws
    best = client.completions.create(n=1, best_of=3, **kwargs)
    assert [c.index for c in best.choices] == [0]
    assert best.choices[0].text in samples and best.choices[0].finish_reason == "length"
    assert best.usage.completion_tokens == 8  # returned choices only
    two = client.completions.create(n=2, best_of=3, **kwargs)
    assert [c.index for c in two.choices] == [0, 1]
    assert texts(two)[0] == best.choices[0].text and set(texts(two)) <= set(samples)


def test_streaming_n_2_sends_per_choice_deltas(client):
    kwargs = dict(model=MODEL, prompt=random_ids(30, seed=23), n=2, max_tokens=10, temperature=1.0, seed=31,
                  extra_body=IGNORE_EOS)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed, finishes = {0: "", 1: ""}, []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        streamed[choice.index] += choice.text
        if choice.finish_reason:
            finishes.append((choice.index, choice.finish_reason))
    assert streamed == {c.index: c.text for c in full.choices}
    assert sorted(finishes) == [(0, "length"), (1, "length")]  # each choice finishes exactly once
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens) == (30, 20)
    assert usage.prompt_tokens_details.cached_tokens == 16  # the prompt's one full block, counted once


def test_chat_streaming_n_2_role_chunks_and_finishes(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "two streams"}], n=2, max_tokens=5, temperature=0,
        stream=True, extra_body=IGNORE_EOS,
    ))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    contents = {0: "", 1: ""}
    for chunk in chunks:
        contents[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert contents[0] == contents[1] and contents[0]
    finishes = sorted((c.choices[0].index, c.choices[0].finish_reason)
                      for c in chunks if c.choices[0].finish_reason)
    assert finishes == [(0, "length"), (1, "length")]


# --- beam search -----------------------------------------------------------------------------------------


def assert_same_hypotheses(choices, expected) -> None:
    assert [c.index for c in choices] == list(range(len(expected)))
    for choice, hypothesis in zip(choices, expected, strict=True):
        info = choice.model_extra["kvserve"]
        assert info["token_ids"] == hypothesis.token_ids
        assert choice.text == hypothesis.text and choice.finish_reason == hypothesis.finish_reason
        assert info["score"] == pytest.approx(hypothesis.score, rel=1e-4, abs=1e-5)
        assert info["cumulative_logprob"] == pytest.approx(hypothesis.cumulative_logprob, rel=1e-4, abs=1e-5)


def test_beam_search_matches_the_engine(client, llm):
    response = client.completions.create(model=MODEL, prompt=BEAM_PROMPT, max_tokens=8, n=2,
                                         extra_body={"use_beam_search": True, "beam_width": 4})
    expected = llm.beam_search(BEAM_PROMPT, beam_width=4, max_tokens=8, num_return_sequences=2)[0].outputs
    assert_same_hypotheses(response.choices, expected)  # best first
    assert response.usage.prompt_tokens == len(BEAM_PROMPT)
    assert response.usage.completion_tokens == sum(len(h.token_ids) for h in expected)


def test_beam_search_streams_each_choice_whole(client, llm):
    extra = {"use_beam_search": True, "beam_width": 3, "length_penalty": 0.5, "early_stopping": True}
    chunks = list(client.completions.create(model=MODEL, prompt=BEAM_PROMPT, max_tokens=8, n=3, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra))
    expected = llm.beam_search(BEAM_PROMPT, beam_width=3, max_tokens=8, length_penalty=0.5,
                               early_stopping=True, num_return_sequences=3)[0].outputs
    assert all(len(chunk.choices) == 1 for chunk in chunks[:-1])
    assert_same_hypotheses([chunk.choices[0] for chunk in chunks[:-1]], expected)
    assert chunks[-1].usage.completion_tokens == sum(len(h.token_ids) for h in expected)


def test_disconnect_mid_beam_search_frees_every_block(server, client):  # noqa: F811
    aborted_before = metric_value(server.url, ABORTED, default=0.0)
    prompt = random_ids(40, seed=25)  # 3 blocks: more in use means the beams forked and are decoding
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1000, n=2, stream=True,
                                       extra_body={"use_beam_search": True, "beam_width": 4})
    deadline = time.monotonic() + 30
    while metric_value(server.url, USED_BLOCKS) <= 3:
        assert time.monotonic() < deadline, "beam search never forked"
        time.sleep(0.05)
    stream.close()
    counts = wait_until_drained(server.url, timeout=15)
    assert counts["free"] + counts["cached"] == metric_value(server.url, "kvserve_kv_cache_num_blocks")
    assert metric_value(server.url, ABORTED) == aborted_before + 1  # one engine request: the whole group


# --- bad combinations ------------------------------------------------------------------------------------


def completion_body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "x", **fields}).encode()


def chat_body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], **fields}).encode()


BEAM = {"use_beam_search": True}
FIVE = ["a", "b", "c", "d", "e"]
BAD_COMBINATIONS = [
    # (path, raw body, expected param)
    ("/v1/completions", completion_body(n=2, best_of=1), "best_of"),
    ("/v1/completions", completion_body(best_of=17), "best_of"),
    ("/v1/completions", completion_body(best_of=3, stream=True), "best_of"),
    ("/v1/chat/completions", chat_body(best_of=2, stream=True), "best_of"),
    ("/v1/chat/completions", chat_body(n=3, best_of=2), "best_of"),
    ("/v1/completions", completion_body(prompt=FIVE, best_of=16), "best_of"),
    ("/v1/completions", completion_body(prompt=FIVE, beam_width=16, **BEAM), "beam_width"),
    ("/v1/completions", completion_body(n=3, beam_width=2, **BEAM), "n"),
    ("/v1/completions", completion_body(beam_width=0, **BEAM), "beam_width"),
    ("/v1/completions", completion_body(beam_width=4, stop="a", **BEAM), "stop"),
    ("/v1/completions", completion_body(beam_width=4, best_of=4, **BEAM), "best_of"),
    ("/v1/completions", completion_body(beam_width=4, logprobs=1, **BEAM), "logprobs"),
    ("/v1/completions", completion_body(beam_width=4, temperature=0.7, **BEAM), "temperature"),
    ("/v1/completions", completion_body(beam_width=4, ignore_eos=True, **BEAM), "ignore_eos"),
    ("/v1/completions", completion_body(beam_width=4, early_stopping="sometimes", **BEAM), "early_stopping"),
    ("/v1/completions", completion_body(beam_width=4, length_penalty="long", **BEAM), "length_penalty"),
    ("/v1/completions", completion_body(use_beam_search="yes"), "use_beam_search"),
    ("/v1/completions", completion_body(beam_width=4), "beam_width"),
    ("/v1/completions", completion_body(length_penalty=2.0), "length_penalty"),
    ("/v1/chat/completions", chat_body(**BEAM), "use_beam_search"),
]


def test_bad_parallel_and_beam_options_get_400_naming_the_param(server):  # noqa: F811
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, body, param in BAD_COMBINATIONS:
            response = http.post(path, content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
    wait_until_drained(server.url)  # nothing was queued
