"""Routing over a worker's host tier end to end: two real workers (tiny chat model, API keys, KV events,
small pools, a host RAM tier) behind kv_events routers served from this process.

A prompt computed on w0 and then pushed out of its pool by other prompts is demoted into w0's host tier;
w0's events say so (medium "CPU") and the router's index moves the blocks from w0's device entries to its
host entries. With w0 a little busier than w1 in the router's books, a follow-up goes to w0 (reason
`cache_hit`), which loads the prefix from host RAM (its usage says `host`) and answers as it did before;
a device-only router (`tier_fetch_cost=1`) sends it to w1 instead. No block stays in use on either worker.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvserve.events.format import MEDIUM_CPU
from kvserve.prefix.hashing import block_hashes
from kvserve.router.config import RouterConfig
from kvserve.router.thread import RouterThread
from kvserve.server.launcher import launch_server
from test_router_support import ADMIN as OPS
from test_router_support import (
    complete,
    complete_behind,
    metric,
    route_of,
    wait_for,
    wait_for_streams,
    write_keys,
)
from test_server_support import chat_model_dir, wait_until_drained  # noqa: F401


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    return write_keys(tmp_path_factory.mktemp("tier-keys"))


@pytest.fixture(scope="module")
def workers(chat_model_dir, keys):  # noqa: F811
    from kvserve.router.cluster import worker_events_argv

    argv = [["--model", str(chat_model_dir), "--num-blocks", "24", "--api-keys", str(keys), "--host-cache", "64MiB",
             *worker_events_argv("127.0.0.1")] for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda args: launch_server(args, startup_timeout=120), argv))
    yield started
    for worker in started:
        worker.terminate()




def push_out(url: str) -> None:
    """Ten other 80-token prompts: what came before leaves the worker's 24-block pool for its host tier."""
    for first in range(200, 210):
        complete(url, [first, *range(100, 179)])




def test_a_prefix_demoted_to_host_ram_keeps_its_requests_on_its_worker(workers, chat_model_dir, keys):  # noqa: F811
    w0, w1 = workers
    load = httpx.get(w0.url + "/load", headers=OPS).json()
    assert load["tier_blocks"] > 0 and load["block_size"] == 16
    follow_up = list(range(3, 73)) + [80, 81, 82]  # 4 full blocks of 16, and 9 tokens
    expected = complete(w0.url, follow_up).json()["choices"][0]["text"]
    for tier_fetch_cost, chosen in ((0.1, w0), (1.0, w1)):
        httpx.post(w0.url + "/reset_prefix_cache", params={"tiers": "true"}, headers=OPS).raise_for_status()
        config = RouterConfig(workers=[w0.url, w1.url], model=str(chat_model_dir), api_keys=str(keys),
                              policy="kv_events", poll_interval=0.2, tier_fetch_cost=tier_fetch_cost)
        routed = demote_then_route(config, w0.url, follow_up, load["prefix_hash"])
        route = route_of(routed)
        assert route["worker"] == chosen.url, (tier_fetch_cost, route)
        assert routed.json()["choices"][0]["text"] == expected
        if chosen is w0:
            assert route["reason"] == "cache_hit", route
            usage = routed.json()["usage"]["prompt_tokens_details"]
            assert usage["cached_tokens_by_source"].get("host", 0) >= 48, usage
    for worker in workers:
        wait_until_drained(worker.url, OPS)


def demote_then_route(config: RouterConfig, holder_url: str, prompt: list[int], prefix_hash: str) -> httpx.Response:
    """Compute `prompt` on the holder, push its blocks into the holder's host tier (waiting until the router's
    index says so), then send it through the router with the holder 40 prefill tokens behind."""
    hashes = block_hashes(prompt, 16, ("alice", ""), prefix_hash)[:4]
    with RouterThread(config) as thread:
        policy = thread.router.policy
        wait_for_streams(policy, 2)
        complete(holder_url, prompt)
        wait_for(lambda: all(policy.index.holds(holder_url, h) for h in hashes))
        push_out(holder_url)
        host = policy.index.lower(MEDIUM_CPU)
        wait_for(lambda: all(host.holds(holder_url, h) for h in hashes)
                 and not policy.index.holds(holder_url, hashes[0]))
        assert metric(thread.url, "kvserve_router_index_blocks", {"worker": holder_url, "medium": "CPU"}) >= 4
        holder = next(w for w in thread.router.pool.workers if w.url == holder_url)
        return complete_behind(thread.url, holder, 40, prompt)  # worth a host load, not a recompute
