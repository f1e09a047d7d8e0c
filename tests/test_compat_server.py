"""vLLM server conventions end to end, on one server configured through a YAML file, `KVSERVE_*`
environment variables and the positional MODEL: served names, operator keys, inline chat template,
CORS, /tokenize /detokenize /version /ping /v1/models/{id}, the metrics every Grafana panel reads,
tokens of an aborted stream, and the periodic stats line."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.server.launcher import launch_server
from test_server_support import chat_model_dir, metric_value, wait_until_drained  # noqa: F401

KEY = "sk-operator-2"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}:{{ m['content'] }}>>{% endfor %}"
DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "kvserve.json"
ORIGIN = "http://dashboard.example"


@pytest.fixture(scope="module")
def server(chat_model_dir, tmp_path_factory):  # noqa: F811
    config = tmp_path_factory.mktemp("compat") / "serve.yaml"
    config.write_text(
        "served-model-name: [tiny-chat, alias]\n"
        "num_blocks: 256\n"
        "stats-log-interval: 0.3\n"
        f"allowed-origins: ['{ORIGIN}']\n"
    )
    env = {"KVSERVE_API_KEY": f"sk-operator-1,{KEY}", "KVSERVE_CONFIG": str(config)}
    process = launch_server([str(chat_model_dir), "--chat-template", TEMPLATE], env=env, startup_timeout=120)
    with process:
        yield process


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def test_served_names_are_listed_and_accepted(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-chat", "alias"]
    assert client.models.retrieve("alias").id == "alias"
    missing = httpx.get(f"{server.url}/v1/models/nope", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    response = client.completions.create(model="alias", prompt="hello", max_tokens=2)
    assert response.model == "alias" and response.choices[0].text is not None
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="smollm2-135m", prompt="hello", max_tokens=2)


def test_operator_keys_from_the_environment(server):
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    other = {"Authorization": "Bearer sk-operator-1"}
    assert httpx.get(f"{server.url}/v1/models", headers=other).status_code == 200
    assert httpx.get(f"{server.url}/metrics", headers=other).status_code == 200  # operator = admin


def test_version_and_ping_need_no_key(server):
    from kvserve import __version__

    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/ping").status_code == 200


def test_tokenize_counts_what_completions_prefill(server, client):
    prompt = "The quick brown fox jumps"
    tokenized = httpx.post(f"{server.url}/tokenize", headers=AUTH,
                           json={"model": "alias", "prompt": prompt, "return_token_strs": True}).json()
    usage = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=1).usage
    assert tokenized["count"] == len(tokenized["tokens"]) == usage.prompt_tokens
    assert "".join(tokenized["token_strs"]) == prompt and tokenized["max_model_len"] == 2048
    back = httpx.post(f"{server.url}/detokenize", headers=AUTH, json={"tokens": tokenized["tokens"]}).json()
    assert back == {"prompt": prompt}


def test_tokenize_messages_uses_the_inline_chat_template(server, client):
    messages = [{"role": "user", "content": "hi there"}]
    tokenized = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"messages": messages}).json()
    text = httpx.post(f"{server.url}/detokenize", headers=AUTH, json={"tokens": tokenized["tokens"]}).json()
    assert text["prompt"] == "<<user:hi there>>"
    usage = client.chat.completions.create(model="alias", messages=messages, max_tokens=1).usage
    assert usage.prompt_tokens == tokenized["count"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": "x", "tools": []}, "tools"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, "model"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenize_refuses_bad_input_naming_the_field(server, path, body, param):
    response = httpx.post(f"{server.url}{path}", headers=AUTH, json=body)
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["param"] == param


def test_cors_answers_only_the_allowed_origin(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = httpx.options(f"{server.url}/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{server.url}/v1/completions", headers={"Origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers


def test_aborted_stream_tokens_are_counted(server, client):
    wait_until_drained(server.url, headers=AUTH)
    generated = "kvserve_generation_tokens_total"
    finished = "kvserve_request_generation_tokens_count"
    aborted = 'kvserve_request_success_total{finished_reason="abort"}'
    before = {name: metric_value(server.url, name, AUTH) for name in (generated, finished, aborted)}
    stream = client.completions.create(model="tiny-chat", prompt="Once upon", max_tokens=1500, stream=True,
                                       extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += 1 if chunk.choices and chunk.choices[0].text is not None else 0
        if received == 8:
            break
    stream.close()
    wait_until_drained(server.url, headers=AUTH)
    after = {name: metric_value(server.url, name, AUTH) for name in (generated, finished, aborted)}
    assert after[generated] - before[generated] >= 8  # counted as produced, though never finished
    assert after[finished] == before[finished]  # the per-request length histogram: finished requests only
    assert after[aborted] == before[aborted] + 1


def test_every_series_has_the_model_name_label(server, client):
    client.completions.create(model="tiny-chat", prompt="label check", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples
               if s.name.startswith("kvserve_")]
    assert len(samples) > 100
    assert {s.labels.get("model_name") for s in samples} == {"tiny-chat"}


def test_every_dashboard_query_resolves(server, client):
    for n in (1, 2):
        client.completions.create(model="tiny-chat", prompt=f"dashboard {n}", max_tokens=4, n=n)
    client.chat.completions.create(model="alias", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    present = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    expressions = [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"]
                   for target in panel["targets"]]
    assert len(expressions) >= 20
    for expr in expressions:
        names = set(re.findall(r"\bkvserve_[a-z0-9_]+", expr))
        assert names, expr
        assert names <= present, f"{sorted(names - present)} in {expr!r} not exported"
    for histogram in ("e2e_request_latency_seconds", "request_queue_time_seconds", "inter_token_latency_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert metric_value(server.url, f"kvserve_{histogram}_count", AUTH) > 0, histogram


def test_periodic_stats_line_in_the_log(server, client):
    client.completions.create(model="tiny-chat", prompt="log line", max_tokens=4)
    deadline = time.monotonic() + 10
    pattern = re.compile(r"Avg prompt throughput: [0-9.]+ tokens/s, Avg generation throughput: [0-9.]+ tokens/s, "
                         r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [0-9.]+%, Prefix cache hit rate")
    while not pattern.search(server.log_tail(200_000)):
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.2)
