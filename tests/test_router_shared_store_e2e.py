"""Routing over a shared store end to end: two real workers (tiny chat model, API keys, KV events) on
one real Redis (`--remote-cache`) behind a kv_events router served from this process.

Both workers name the same store in `/load`. A prompt computed on w0 (sent to it directly) is in the
router's index as w0's; with w0's queue made long in the router's books, the follow-up goes to w1 with
reason `shared_store`, w1 loads the prefix from Redis (its usage says `remote`) instead of computing it,
and the greedy answer equals w0's own for the same prompt; no block stays in use on either worker.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvserve.router.config import RouterConfig
from kvserve.router.thread import RouterThread
from kvserve.server.launcher import launch_server
from test_router_support import ADMIN as OPS
from test_router_support import complete, complete_behind, route_of, wait_for, wait_for_streams, write_keys
from test_server_support import chat_model_dir, wait_until_drained  # noqa: F401


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    return write_keys(tmp_path_factory.mktemp("store-keys"))


@pytest.fixture(scope="module")
def workers(chat_model_dir, keys, redis_server):  # noqa: F811
    from kvserve.router.cluster import worker_events_argv

    argv = [["--model", str(chat_model_dir), "--num-blocks", "128", "--api-keys", str(keys), "--host-cache", "0",
             "--remote-cache", redis_server.url, *worker_events_argv("127.0.0.1")] for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda args: launch_server(args, startup_timeout=120), argv))
    yield started
    for worker in started:
        worker.terminate()




def test_a_busy_holders_prompt_goes_where_the_store_can_load_it(workers, chat_model_dir, keys):  # noqa: F811
    w0, w1 = workers
    config = RouterConfig(workers=[w0.url, w1.url], model=str(chat_model_dir), api_keys=str(keys),
                          policy="kv_events", poll_interval=0.2)
    with RouterThread(config) as thread:
        policy, pool = thread.router.policy, thread.router.pool.workers
        wait_for_streams(policy, 2)
        wait_for(lambda: all(w.load.remote_tier == "ok" for w in pool))
        assert pool[0].load.remote_store is not None and pool[0].load.remote_store == pool[1].load.remote_store
        prompt = list(range(3, 73))  # 4 full blocks of 16
        complete(w0.url, prompt)  # computed on w0, written through to Redis
        wait_for(lambda: policy.index.num_blocks(w0.url) >= 4)
        follow_up = prompt + [80, 81, 82]
        expected = complete(w0.url, follow_up).json()["choices"][0]["text"]
        holder = next(w for w in pool if w.url == w0.url)
        routed = complete_behind(thread.url, holder, 10_000, follow_up)  # w0 far behind; w1 can load the prefix
        route = route_of(routed)
        assert route["worker"] == w1.url and route["reason"] == "shared_store", route
        usage = routed.json()["usage"]["prompt_tokens_details"]
        assert usage["cached_tokens_by_source"].get("remote", 0) >= 64, usage
        assert routed.json()["choices"][0]["text"] == expected
    for worker in workers:
        wait_until_drained(worker.url, OPS)
