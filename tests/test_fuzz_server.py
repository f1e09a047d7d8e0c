"""Fuzz a live server with hypothesis-generated request bodies: nothing a caller sends may be a 5xx,
kill the engine, or leave a block in use once the engine drains.

Bodies are valid-looking requests of four kinds (text completion with every sampling field and
logprobs; beam search; chat; a Responses API request with input items, instructions and a made-up
previous_response_id) with edge values (n=16, top_p=1e-300, temperature=1e-45, unicode with
lone surrogates, streaming read whole or hung up after the first event), and up to two fields set to
something wild (NaN, infinities, 1e-45, 2**64, 1100, wrong JSON types). Valid requests are kept cheap
(max_tokens <= 12, short prompts) so the run stays bounded (a tiny model and a 128-block pool).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvserve.server.launcher import ServerProcess
from test_server_support import chat_model_dir, start_server, wait_until_drained  # noqa: F401

MODEL = "tiny-chat"
EXTREMES = [0, 1, -1, 2, 16, 17, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 0.5, 1e-45, 5e-6, 1e-300, 1e308,
            -1e308, float("nan"), float("inf"), float("-inf"), 1.0000001, 100.0, 100.5, 10.0, -10.0, 1100.0]
WRONG_TYPES = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.just([1, "a"]), st.just({"x": 1}))
WILD = st.one_of(st.sampled_from(EXTREMES), st.integers(-5, 20), st.floats(-3, 3), WRONG_TYPES)
TEXT = st.text(st.characters(codec=None), max_size=40)  # any code point, lone surrogates too
IDS = st.lists(st.integers(3, 380), min_size=1, max_size=60)
UNIT = st.floats(0, 1, exclude_min=True)

# Valid values (edges included): most bodies are runnable, so the engine really runs them.
SAMPLING = {
    "max_tokens": st.integers(1, 12),
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 1e-45, 5e-6, 1e-5, 100.0])),
    "top_p": st.one_of(UNIT, st.sampled_from([1e-300, 1e-9, 1.0])), "top_k": st.integers(-1, 600),
    "min_p": st.floats(0, 1), "seed": st.integers(-(2**63), 2**64 - 1),
    "n": st.one_of(st.integers(1, 4), st.just(16)), "best_of": st.integers(1, 6),
    "stop": st.lists(TEXT.filter(bool), max_size=3), "ignore_eos": st.booleans(), "cache_salt": TEXT,
    "stream": st.booleans(), "stream_options": st.just({"include_usage": True}),
}
PROMPT = st.one_of(TEXT.filter(bool), IDS, st.lists(TEXT.filter(bool), min_size=1, max_size=3),
                   st.lists(IDS, min_size=1, max_size=3))
COMPLETION = {**SAMPLING, "logprobs": st.integers(0, 5)}
BEAM = {
    "use_beam_search": st.just(True), "beam_width": st.integers(1, 4), "n": st.integers(1, 4),
    "max_tokens": st.integers(1, 12), "length_penalty": st.one_of(st.floats(-10, 10), st.sampled_from([-10, 10])),
    "early_stopping": st.sampled_from([True, False, "never"]), "stream": st.booleans(),
}
CONTENT = st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": CONTENT})
CHAT = {**SAMPLING, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)}
INPUT_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]),
                           "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text"]), "text": TEXT}), max_size=2))}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXT, "output": TEXT}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": TEXT, "name": TEXT, "arguments": TEXT}),
)
RESPONSES = {
    "max_output_tokens": st.integers(1, 12), "temperature": SAMPLING["temperature"], "top_p": SAMPLING["top_p"],
    "top_k": SAMPLING["top_k"], "seed": SAMPLING["seed"], "stream": st.booleans(), "store": st.booleans(),
    "instructions": TEXT, "cache_salt": TEXT, "previous_response_id": st.text(max_size=12),
    "text": st.sampled_from([{"format": {"type": "json_object"}}, {"format": {"type": "text"}}]),
}
FIELDS = sorted({*COMPLETION, *BEAM, *CHAT, *RESPONSES, "prompt", "messages", "input", "max_completion_tokens",
                 "presence_penalty", "frequency_penalty", "echo", "model"})
BUDGETS = ("max_tokens", "max_output_tokens")  # kept cheap when made wild


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict]:
    """A valid-looking body of one of three kinds, then maybe one or two fields set to something wild."""
    kind = draw(st.sampled_from(["completion", "beam", "chat", "responses"]))
    budget = "max_tokens"
    if kind == "chat":
        path, fields = "/v1/chat/completions", {"messages": st.lists(MESSAGE, min_size=1, max_size=3)}
        optional = CHAT
    elif kind == "responses":
        path, fields = "/v1/responses", {"input": st.one_of(TEXT, st.lists(INPUT_ITEM, min_size=1, max_size=3))}
        optional, budget = RESPONSES, "max_output_tokens"
    else:
        path, fields, optional = "/v1/completions", {"prompt": PROMPT}, COMPLETION if kind == "completion" else BEAM
    required = {"model": st.just(MODEL), **fields, budget: optional[budget]}
    body = draw(st.fixed_dictionaries(required, optional={k: v for k, v in optional.items() if k not in required}))
    for name, value in draw(st.lists(st.tuples(st.sampled_from(FIELDS), WILD), max_size=2)):
        if name not in BUDGETS or (isinstance(value, int) and not 0 < value <= 12):
            body[name] = value  # a wild budget stays cheap: refused, or small
    return path, body


@pytest.fixture(scope="module")
def fuzz_server(chat_model_dir) -> Iterator[ServerProcess]:  # noqa: F811
    flags = ["--max-num-seqs", "8", "--max-queue", "64"]
    with start_server(chat_model_dir, *flags, num_blocks=128) as process:
        yield process
        counts = wait_until_drained(process.url, timeout=30)
        assert counts["used"] == 0, counts


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(request=bodies(), hang_up=st.booleans())
@example(request=("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "use_beam_search": True,
                                      "n": 2, "length_penalty": 1100}), hang_up=False)  # the killer
@example(request=("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "use_beam_search": True,
                                      "n": 2, "length_penalty": -2000}), hang_up=False)
@example(request=("/v1/responses", {"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c",
                                                                 "output": "x"}], "max_output_tokens": 4,
                                     "previous_response_id": "resp_unknown", "stream": True}), hang_up=False)
def test_no_body_is_a_5xx_or_kills_the_engine(fuzz_server, request, hang_up):
    path, body = request
    raw = json.dumps(body, allow_nan=True)  # NaN / Infinity literals on purpose
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as client:
        with client.stream("POST", path, content=raw, headers=headers) as response:
            assert response.status_code < 500, (response.status_code, response.read(), raw)
            if hang_up and body.get("stream") is True:
                next(response.iter_lines(), None)  # then close: the server aborts the rest
            else:
                text = response.read().decode()
                assert "server_error" not in text, (text, raw)  # no in-band engine error either
                if response.status_code == 200 and body.get("stream") is not True:
                    assert json.loads(text)["output" if path == "/v1/responses" else "choices"] is not None
        health = client.get("/health")
        assert health.status_code == 200, (health.text, raw, fuzz_server.log_tail())


def test_pool_drained_after_fuzzing(fuzz_server):
    assert wait_until_drained(fuzz_server.url, timeout=30)["used"] == 0
