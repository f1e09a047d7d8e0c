"""A real server with a host tier and KV events: device evictions reach the event stream as CPU blocks,
`/load` says how many blocks the tiers hold, and `POST /reset_prefix_cache?tiers=true` empties them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvserve.events.format import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from kvserve.events.subscriber import EventStream
from kvserve.router.cluster import worker_events_argv
from kvserve.server.launcher import ServerProcess
from test_server_e2e import random_ids
from test_server_support import chat_model_dir, metric_value, start_server, wait_until_drained  # noqa: F401

BLOCK = 16  # the server's default block size
HOST_BYTES = 1 << 20
HOST_METRIC = 'kvserve_kv_tier_blocks{tier="host"}'


class Collect:
    """An event handler keeping every event of the stream, in order."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def apply(self, batch: KVEventBatch) -> None:
        self.events.extend(batch.events)

    def reset(self, reason: str) -> None:
        raise AssertionError(f"the event stream lost history: {reason}")


@pytest.fixture(scope="module")
def tier_server(chat_model_dir) -> Iterator[tuple[ServerProcess, list[str]]]:  # noqa: F811
    """16 device blocks over a 1 MiB host tier, publishing KV events (with a replay socket)."""
    events_argv = worker_events_argv("127.0.0.1")
    with start_server(chat_model_dir, "--host-cache", str(HOST_BYTES), *events_argv, num_blocks=16) as process:
        yield process, events_argv


def events_when(server: tuple[ServerProcess, list[str]], done: Callable[[list[KVEvent]], bool]) -> list[KVEvent]:
    """Everything the server has published, once `done` holds (publishing is asynchronous)."""
    _, argv = server
    deadline = time.monotonic() + 15
    while True:
        handler = Collect()
        asyncio.run(EventStream(argv[1], handler, argv[3]).catch_up())
        if done(handler.events) or time.monotonic() > deadline:
            return handler.events
        time.sleep(0.05)


def hashes(events: list[KVEvent], kind: type, medium: str) -> list[bytes]:
    return [h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]


def complete(url: str, prompt: list[int]) -> dict:
    body = {"model": "tiny-chat", "prompt": prompt, "max_tokens": 1}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]


def payload_bytes(model_dir) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return 32 + config["num_hidden_layers"] * 2 * BLOCK * config["num_key_value_heads"] * head_dim * 4


def test_load_reports_the_blocks_the_tiers_hold(tier_server, chat_model_dir):  # noqa: F811
    load = httpx.get(f"{tier_server[0].url}/load").json()
    assert load["tier_blocks"] == HOST_BYTES // payload_bytes(chat_model_dir) > 0


def test_evictions_are_published_as_cpu_blocks_and_a_tier_reset_removes_them(tier_server):
    url = tier_server[0].url
    prompts = [random_ids(100, seed=seed) for seed in range(30, 35)]  # 6 full blocks each: the first is pushed out
    for prompt in prompts:
        complete(url, prompt)
    wait_until_drained(url)
    events = events_when(tier_server, lambda e: bool(hashes(e, BlockStored, MEDIUM_CPU)))
    demoted = hashes(events, BlockStored, MEDIUM_CPU)
    assert demoted and sorted(demoted) == sorted(set(hashes(events, BlockRemoved, MEDIUM_GPU)))
    assert metric_value(url, HOST_METRIC) == len(demoted)

    assert httpx.post(f"{url}/reset_prefix_cache").json() == {"success": True}
    assert metric_value(url, HOST_METRIC) == len(demoted)  # the device's reset keeps the host's blocks
    assert complete(url, prompts[0])["cached_tokens_by_source"].get("host", 0) > 0
    wait_until_drained(url)

    assert httpx.post(f"{url}/reset_prefix_cache", params={"tiers": "true"}).json() == {"success": True}
    assert metric_value(url, HOST_METRIC) == 0
    events = events_when(tier_server, lambda e: bool(hashes(e, BlockRemoved, MEDIUM_CPU)))
    assert sorted(hashes(events, BlockRemoved, MEDIUM_CPU)) == sorted(hashes(events, BlockStored, MEDIUM_CPU))
    assert complete(url, prompts[0])["cached_tokens"] == 0
