"""In-process tests: API key files and namespaces, the AsyncEngine thread, the app on a crashed engine."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.params import SamplingParams
from kvserve.server.app import build_app
from kvserve.server.auth import (
    SINGLE_TENANT,
    AuthError,
    Principal,
    authenticate,
    cache_namespace,
    load_api_keys,
)
from kvserve.serving.async_engine import AsyncEngine, EngineDeadError, RequestSpec
from test_server_support import chat_model_dir  # noqa: F401

# --- API keys and namespaces ------------------------------------------------------------------------------


def test_key_files_toml_and_json_agree(tmp_path):
    toml = tmp_path / "keys.toml"
    toml.write_text('[keys]\n"k1" = "alice"\n"k2" = { tenant = "ops", admin = true }\n')
    as_json = tmp_path / "keys.json"
    as_json.write_text(json.dumps({"keys": {"k1": "alice", "k2": {"tenant": "ops", "admin": True}}}))
    for path in (toml, as_json):
        keys = load_api_keys(path)
        assert authenticate("Bearer k1", keys) == Principal("alice", is_admin=False)
        assert authenticate("bearer k2", keys) == Principal("ops", is_admin=True)


@pytest.mark.parametrize("document", [
    "{}", '{"keys": []}', '{"keys": {}}', '{"keys": {"k": ""}}', '{"keys": {"a key": "t"}}',
    '{"keys": {"k": {"tenant": "t", "admin": "yes"}}}', '{"keys": {"k": {"tenant": "t", "role": "x"}}}',
    "not json or toml [",
])
def test_malformed_key_files_are_rejected(tmp_path, document):
    path = tmp_path / "keys"
    path.write_text(document)
    with pytest.raises(ValueError):
        load_api_keys(path)


def test_authenticate(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text('{"keys": {"secret": "alice"}}')
    keys = load_api_keys(path)
    for header in (None, "", "Bearer", "Basic secret", "Bearer wrong", "Bearer secretx"):
        with pytest.raises(AuthError) as info:
            authenticate(header, keys)
        assert info.value.status == 401
    assert authenticate(None, None) is SINGLE_TENANT


def test_namespaces_keep_tenant_and_salt_apart():
    alice, bob = Principal("alice", False), Principal("bob", False)
    assert cache_namespace(alice, None) == ("alice", "")
    assert cache_namespace(alice, "s") == ("alice", "s")
    # A salt is a separate field: bob naming alice's tenant still lands in bob's namespace.
    assert cache_namespace(bob, "alice") == ("bob", "alice") != cache_namespace(alice, None)
    assert cache_namespace(SINGLE_TENANT, None) == ()
    assert cache_namespace(SINGLE_TENANT, "s") == ("s",)
    for bad in ("", "a/b", "a@b", "x" * 129, "nul\x00"):
        with pytest.raises(ValueError):
            cache_namespace(alice, bad)


# --- AsyncEngine ----------------------------------------------------------------------------------------


@pytest.fixture
def async_engine(chat_model_dir):  # noqa: F811
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(chat_model_dir), num_blocks=128), progress=False))
    engine.start()
    yield engine
    engine.shutdown()


GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def test_generate_streams_deltas_that_add_up(async_engine):
    async def run() -> tuple[str, list, list]:
        deltas, tokens = [], []
        async for output in async_engine.generate([5, 6, 7, 8], GREEDY, "r1"):
            deltas.append(output.delta_text)
            tokens.extend(output.delta_token_ids)
        return "".join(deltas), tokens, output

    text, tokens, final = asyncio.run(run())
    assert final.finished and final.finish_reason == "length"
    assert text == final.text and tokens == final.token_ids and len(tokens) == 20
    assert async_engine.stats()["used_blocks"] == 0


def test_invalid_group_queues_nothing(async_engine):
    async def run() -> None:
        specs = [RequestSpec([5, 6], GREEDY, "ok"), RequestSpec([], GREEDY, "empty")]
        with pytest.raises(ValueError, match="prompt is empty"):
            await async_engine.add_requests(specs)
        assert await async_engine.call(lambda engine: sorted(engine.requests)) == []

    asyncio.run(run())


def test_abort_mid_stream_frees_blocks(async_engine):
    async def run() -> None:
        params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
        group = await async_engine.add_requests([RequestSpec(list(range(3, 60)), params, "long")])
        async for _, output in group:
            if len(output.token_ids) >= 3:
                break
        assert group.abort() == 1
        stats = await async_engine.call(lambda engine: engine.stats())
        assert stats["used_blocks"] == 0 and stats["num_running"] == 0
        assert stats["free_blocks"] + stats["cached_blocks"] == stats["num_blocks"]

    asyncio.run(run())


def test_idle_engine_thread_sleeps(async_engine):
    before = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - before < 0.1  # a busy-spinning loop would burn ~0.5 s of CPU


def test_shutdown_drain_finishes_in_flight_then_refuses(async_engine):
    async def run() -> None:
        group = await async_engine.add_requests([RequestSpec([5, 6, 7], GREEDY, "drained")])
        await asyncio.to_thread(async_engine.shutdown, True)
        outputs = [output async for _, output in group]
        assert outputs[-1].finish_reason == "length" and len(outputs[-1].token_ids) == 20
        with pytest.raises(EngineDeadError):
            await async_engine.add_requests([RequestSpec([5], GREEDY, "late")])

    asyncio.run(run())
    assert not async_engine.is_alive


def test_engine_crash_fails_streams_and_health(async_engine):
    app = build_app(async_engine, "tiny-chat", api_keys=None, max_queue=8)

    def explode() -> list:
        raise RuntimeError("simulated kernel failure")

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            assert (await http.get("/health")).status_code == 200
            await async_engine.call(lambda engine: setattr(engine, "step", explode))
            with pytest.raises(EngineDeadError):
                async for _ in async_engine.generate([5, 6], GREEDY, "doomed"):
                    pass
            assert not async_engine.is_alive and isinstance(async_engine.error, RuntimeError)
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["reason"] == "engine crashed"
            response = await http.post("/v1/completions", json={"model": "tiny-chat", "prompt": "hi"})
            assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"

    asyncio.run(run())
