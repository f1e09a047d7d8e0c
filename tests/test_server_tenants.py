"""Multi-tenant server (`--api-keys`): authentication, per-tenant cache namespaces, admin-only routes."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvserve.server.launcher import ServerProcess
from test_server_support import chat_model_dir, start_server, wait_until_drained  # noqa: F401

MODEL = "tiny-chat"
KEYS_TOML = """
[keys]
"sk-alice-1" = "alice"
"sk-alice-2" = "alice"
"sk-bob" = "bob"
"sk-ops" = { tenant = "ops", admin = true }
"""
ADMIN = {"Authorization": "Bearer sk-ops"}


@pytest.fixture(scope="module")
def tenant_server(chat_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:  # noqa: F811
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS_TOML)
    with start_server(chat_model_dir, "--api-keys", str(keys)) as process:
        yield process


def client_for(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60)


def cached_tokens(client: openai.OpenAI, prompt: list[int], **extra) -> int:
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra or None)
    return response.usage.prompt_tokens_details.cached_tokens


def test_requests_need_a_valid_key(tenant_server):
    for key in ("wrong-key", "sk-alice-1x"):
        with pytest.raises(openai.AuthenticationError) as info:
            client_for(tenant_server, key).models.list()
        assert info.value.status_code == 401
    no_header = httpx.post(f"{tenant_server.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert no_header.status_code == 401 and no_header.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{tenant_server.url}/health").status_code == 200  # probes need no key
    assert [m.id for m in client_for(tenant_server, "sk-bob").models.list().data] == [MODEL]


def test_same_text_hits_within_a_tenant_and_misses_across(tenant_server):
    prompt = [random.Random(11).randrange(3, 300) for _ in range(200)]
    alice1, alice2, bob = (client_for(tenant_server, key) for key in ("sk-alice-1", "sk-alice-2", "sk-bob"))
    assert cached_tokens(alice1, prompt) == 0  # cold
    assert cached_tokens(alice2, prompt) == 192  # same tenant, other key: hit (12 blocks)
    assert cached_tokens(bob, prompt) == 0  # other tenant, same text: miss (paired with the hit above)
    assert cached_tokens(bob, prompt) == 192  # bob's own copy now hits for bob
    assert cached_tokens(alice1, prompt, cache_salt="narrow") == 0  # a salt narrows within alice
    assert cached_tokens(bob, prompt, cache_salt="alice") == 0  # naming another tenant reaches nothing


def test_streamed_usage_reports_tenant_cache(tenant_server):
    prompt = [random.Random(12).randrange(3, 300) for _ in range(64)]
    alice, bob = client_for(tenant_server, "sk-alice-1"), client_for(tenant_server, "sk-bob")
    cached_tokens(alice, prompt)

    def streamed_cached(client) -> int:
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                                stream_options={"include_usage": True}))
        return chunks[-1].usage.prompt_tokens_details.cached_tokens

    assert streamed_cached(alice) == 48
    assert streamed_cached(bob) == 0


def test_metrics_and_reset_are_admin_only(tenant_server):
    bob = {"Authorization": "Bearer sk-bob"}
    assert httpx.get(f"{tenant_server.url}/metrics", headers=bob).status_code == 403
    assert httpx.get(f"{tenant_server.url}/metrics").status_code == 401
    assert httpx.post(f"{tenant_server.url}/reset_prefix_cache", headers=bob).status_code == 403
    metrics = httpx.get(f"{tenant_server.url}/metrics", headers=ADMIN)
    assert metrics.status_code == 200 and "kvserve_prefix_cache_hits_total" in metrics.text
    assert "alice" not in metrics.text and "bob" not in metrics.text  # no per-tenant labels
    wait_until_drained(tenant_server.url, headers=ADMIN)
    assert httpx.post(f"{tenant_server.url}/reset_prefix_cache", headers=ADMIN).json() == {"success": True}


def test_stored_responses_are_kept_per_tenant(tenant_server):
    alice1, alice2, bob = (client_for(tenant_server, key) for key in ("sk-alice-1", "sk-alice-2", "sk-bob"))
    first = alice1.responses.create(model=MODEL, input="Hello, remember me.", max_output_tokens=4, temperature=0.0)
    assert alice2.responses.retrieve(first.id).output_text == first.output_text  # same tenant, other key
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):  # bob cannot continue (or read through) alice's conversation
        bob.responses.create(model=MODEL, input="What did I say?", previous_response_id=first.id)
    bob_key = {"Authorization": "Bearer sk-bob"}
    assert httpx.delete(f"{tenant_server.url}/v1/responses/{first.id}", headers=bob_key).status_code == 404
    second = alice2.responses.create(model=MODEL, input="Again?", previous_response_id=first.id, max_output_tokens=4)
    assert second.usage.input_tokens_details.cached_tokens > 0  # alice's own prefix
