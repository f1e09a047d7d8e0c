"""End to end: a real `python -m kvserve.server` on a free loopback port, driven by the `openai` client
(and raw httpx for malformed input), over a tiny random Llama with a real tokenizer."""

from __future__ import annotations

import json
import random
import threading

import httpx
import openai
import pytest

from test_server_support import chat_model_dir, metric_value, server, wait_until_drained  # noqa: F401

MODEL = "tiny-chat"
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def random_ids(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(count)]  # ids >= 3: no special tokens


def chat(client, content: str, **kwargs):
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def finish_reasons(chunks) -> list[str]:
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


# --- basic shapes ---------------------------------------------------------------------------------------


def test_the_server_steps_its_engine_on_the_thread_that_built_it(server, client):  # noqa: F811
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert "built on another thread" not in server.log_path.read_text()  # AsyncEngine.spawn (openmp.py)


def test_models_and_health(server, client):  # noqa: F811
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_chat_non_streaming(client):
    response = chat(client, "Hello there", max_tokens=8, temperature=0, extra_body=IGNORE_EOS)
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.model == MODEL
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    usage = response.usage
    assert usage.completion_tokens == 8
    assert usage.prompt_tokens > 5  # the ChatML wrapping alone is several tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streaming_matches_non_streaming(client):
    kwargs = dict(max_tokens=12, temperature=0, extra_body=IGNORE_EOS)
    full = chat(client, "Stream this please", **kwargs)
    usage = {"include_usage": True}
    chunks = list(chat(client, "Stream this please", stream=True, stream_options=usage, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert finish_reasons(chunks) == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_has_none(client):
    chunks = list(chat(client, "no usage", max_tokens=3, stream=True))
    assert chunks and all(c.usage is None for c in chunks)


def test_completion_text_and_token_ids(client):
    prompt = "The quick brown fox"
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0, extra_body=IGNORE_EOS)
    by_text = client.completions.create(prompt=prompt, **kwargs)
    ids = random_ids(20, seed=1)
    by_ids = client.completions.create(prompt=ids, **kwargs)
    streamed = list(client.completions.create(prompt=ids, stream=True, **kwargs))
    assert by_text.object == "text_completion" and by_text.usage.completion_tokens == 6
    assert by_ids.usage.prompt_tokens == 20
    assert "".join(c.choices[0].text for c in streamed) == by_ids.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_completion_batch_of_prompts(client):
    response = client.completions.create(model=MODEL, prompt=["one", "two", "three"], max_tokens=2,
                                         extra_body=IGNORE_EOS)
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert response.usage.completion_tokens == 6


def test_logprobs(client):
    response = chat(client, "logprobs", max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                    extra_body=IGNORE_EOS)
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)  # greedy


# --- sampling ---------------------------------------------------------------------------------------------


def test_n_2_returns_two_seeded_choices(client):
    kwargs = dict(max_tokens=10, temperature=1.0, n=2, seed=123, extra_body=IGNORE_EOS)
    first, second = chat(client, "two answers", **kwargs), chat(client, "two answers", **kwargs)
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1]
    assert texts == [c.message.content for c in sorted(second.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]  # choice i samples with seed + i
    assert first.usage.completion_tokens == 20


def test_seed_reproducibility(client):
    def sample(seed: int) -> str:
        return chat(client, "Tell me a story", max_tokens=16, temperature=1.0, seed=seed,
                    extra_body=IGNORE_EOS).choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(4)}) >= 3


def test_stop_strings(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0, extra_body=IGNORE_EOS)
    text = client.completions.create(**kwargs).choices[0].text
    pairs = [text[i:i + 2] for i in range(2, len(text) - 2)]
    stop = next(pair for pair in pairs if pair.isascii() and pair.isprintable())
    for stop_arg in (stop, [stop, "\x00never"]):
        stopped = client.completions.create(stop=stop_arg, **kwargs).choices[0]
        assert stopped.text == text[:text.find(stop)]
        assert stopped.finish_reason == "stop"


# --- prefix cache -----------------------------------------------------------------------------------------


def test_cached_tokens_on_shared_long_prefix(client):
    prefix = random_ids(300, seed=2)
    first = client.completions.create(model=MODEL, prompt=prefix + [5, 6], max_tokens=1)
    second = client.completions.create(model=MODEL, prompt=prefix + [7, 8, 9], max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 288  # 18 whole blocks of 16


def test_cache_salt_narrows_single_tenant(client):
    prompt = random_ids(100, seed=3)

    def cached(**extra) -> int:
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)
        return response.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="s1") == 0
    assert cached(cache_salt="s1") == 96  # same salt: hit
    assert cached(cache_salt="s2") == 0  # another salt: miss (paired with the hit above)
    assert cached() == 0  # no salt is its own namespace


def test_reset_prefix_cache(server, client):  # noqa: F811
    prompt = random_ids(64, seed=4)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    wait_until_drained(server.url)
    assert httpx.post(f"{server.url}/reset_prefix_cache").json() == {"success": True}
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_reset_prefix_cache_of_the_tiers_too(server, client):  # noqa: F811
    """`?tiers=true` is accepted (its effect on a host tier that holds blocks: tests/test_server_tiers.py);
    `/load` says how many blocks the tiers hold (the default 1 GiB host tier here)."""
    assert httpx.get(f"{server.url}/load").json()["tier_blocks"] > 0
    client.completions.create(model=MODEL, prompt=random_ids(64, seed=5), max_tokens=1)
    wait_until_drained(server.url)
    assert httpx.post(f"{server.url}/reset_prefix_cache?tiers=true").json() == {"success": True}


# --- bad input and faults -------------------------------------------------------------------------------

def chat_body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], **fields}).encode()


def completion_body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "x", **fields}).encode()


BAD_INPUTS = [
    # (path, raw body, expected status, expected param)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", chat_body(messages="hi"), 400, "messages"),
    ("/v1/chat/completions", chat_body(messages=[]), 400, "messages"),
    ("/v1/chat/completions", chat_body(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    ("/v1/chat/completions", chat_body(model="gpt-4"), 404, "model"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}', 400, "model"),
    ("/v1/chat/completions", chat_body(max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", chat_body(max_tokens="5"), 400, "max_tokens"),
    ("/v1/chat/completions", chat_body(max_completion_tokens=-1), 400, "max_completion_tokens"),
    ("/v1/chat/completions", chat_body(n=1000), 400, "n"),
    ("/v1/chat/completions", chat_body(temperature=-1), 400, "temperature"),
    ("/v1/chat/completions", chat_body(top_p=0), 400, "top_p"),
    ("/v1/chat/completions", chat_body(cache_salt="a/b"), 400, "cache_salt"),
    ("/v1/chat/completions", chat_body(top_logprobs=50, logprobs=True), 400, "top_logprobs"),
    ("/v1/completions", completion_body(max_tokens=-3), 400, "max_tokens"),
    ("/v1/completions", completion_body(prompt=""), 400, "prompt"),
    ("/v1/completions", completion_body(prompt=[]), 400, "prompt"),
    ("/v1/completions", completion_body(prompt=[1, 2, 99999]), 400, "prompt"),
    ("/v1/completions", completion_body(prompt=[1, 2.5]), 400, "prompt"),
    ("/v1/completions", completion_body(cache_salt=""), 400, "cache_salt"),
    ("/v1/completions", completion_body(cache_salt="x" * 129), 400, "cache_salt"),
    ("/v1/completions", completion_body(stop=[""]), 400, "stop"),
    ("/v1/completions", completion_body(stream="yes"), 400, "stream"),
    ("/v1/completions", completion_body(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    ("/v1/completions", completion_body(max_tokens=0), 400, "max_tokens"),
]


def test_bad_inputs_get_4xx_while_a_good_request_streams(server, client):  # noqa: F811
    good: dict = {}

    def run_good() -> None:
        stream = chat(client, "keep going", max_tokens=300, temperature=0, stream=True, extra_body=IGNORE_EOS)
        chunks = list(stream)
        good["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        good["finish"] = finish_reasons(chunks)

    thread = threading.Thread(target=run_good)
    thread.start()
    long_prompt = ("word " * 3000).encode()  # far past max_model_len (2048) once tokenized
    cases = [*BAD_INPUTS,
             ("/v1/completions", b'{"model": "tiny-chat", "prompt": "' + long_prompt + b'"}', 400, "prompt"),
             ("/v1/completions", completion_body(max_tokens=5000), 400, "max_tokens"),
             ("/v1/completions", b'{"prompt": "' + b"x" * (17 * 1024 * 1024) + b'"}', 413, None)]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, body, status, param in cases:
            response = http.post(path, content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == status, (body[:120], response.text)
            error = response.json()["error"]
            assert error["param"] == param, (body[:120], error)
            assert error["message"] and error["type"]
    thread.join(timeout=60)
    assert good["finish"] == ["length"] and good["text"]


def test_client_disconnect_aborts_and_frees_blocks(server, client):  # noqa: F811
    stream = client.completions.create(model=MODEL, prompt=random_ids(40, seed=5), max_tokens=1500,
                                       temperature=0, stream=True, extra_body=IGNORE_EOS)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    assert metric_value(server.url, 'kvserve_kv_cache_blocks{state="used"}') > 0
    stream.close()
    counts = wait_until_drained(server.url, timeout=10)
    assert counts["free"] + counts["cached"] == metric_value(server.url, "kvserve_kv_cache_num_blocks")
    assert metric_value(server.url, 'kvserve_request_success_total{finished_reason="abort"}') >= 1


def test_non_streaming_client_that_hangs_up_is_aborted(server):  # noqa: F811
    aborted = 'kvserve_request_success_total{finished_reason="abort"}'
    aborted_before = metric_value(server.url, aborted, default=0.0)
    body = {"model": MODEL, "prompt": random_ids(40, seed=7), "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    wait_until_drained(server.url, timeout=10)
    assert metric_value(server.url, aborted) == aborted_before + 1  # aborted, not run to its 1,500 tokens


def test_metrics_names(server, client):  # noqa: F811
    hits_before = metric_value(server.url, "kvserve_prefix_cache_hits_total")
    prompt = random_ids(40, seed=6)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, extra_body=IGNORE_EOS)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("kvserve_prefix_cache_queries_total", "kvserve_prefix_cache_hits_total",
                 "kvserve_kv_cache_usage_perc", "kvserve_num_requests_running",
                 "kvserve_num_requests_waiting", "kvserve_num_preemptions_total",
                 "kvserve_time_to_first_token_seconds_bucket",
                 "kvserve_time_per_output_token_seconds_bucket"):
        assert f"\n{name}" in text, name
    assert metric_value(server.url, "kvserve_time_to_first_token_seconds_count") > 0
    assert metric_value(server.url, "kvserve_time_per_output_token_seconds_count") > 0
    assert metric_value(server.url, "kvserve_prefix_cache_hits_total") - hits_before == 32  # 2 blocks reused
