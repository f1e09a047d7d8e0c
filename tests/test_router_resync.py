"""kv_events across a worker restart, with real processes: two `python -m kvserve.server` workers (tiny
chat model) publishing KV events on fixed endpoints, and two kv_events routers over them:

- `live` polls every 0.2 s: it sees worker A die (requests that had not started go to B, none fails),
  drops A's index at once, and when A comes back on the same port and event endpoints it rejoins with
  a fresh stream and an empty index that A's new events then rebuild;
- `blind` polls once a minute, so it never notices the restart: its old subscription reconnects to A's
  new publisher by itself, and the sequence numbers starting again from 0 make it reset A's index.

Either way the router only claims for A what A's new process has cached, and a prompt A holds again is
routed back to A.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.prefix.hashing import block_hashes
from kvserve.router.cluster import worker_events_argv
from kvserve.router.config import RouterConfig
from kvserve.router.thread import RouterThread
from kvserve.server.launcher import launch_server
from test_router_support import metric, wait_for
from test_server_support import chat_model_dir  # noqa: F401

MODEL = "tiny-chat"
GREEDY = {"temperature": 0, "ignore_eos": True}
PREFIX = list(range(3, 67))  # 64 tokens: 4 full blocks of 16
OTHER = list(range(100, 164))


def body(prompt: list[int], max_tokens: int = 2) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **GREEDY}


def complete(url: str, prompt: list[int], max_tokens: int = 2) -> dict:
    response = httpx.post(url + "/v1/completions", json=body(prompt, max_tokens), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def synced(policy, count: int) -> bool:
    streams = list(policy.streams.values())
    return len(streams) == count and all(stream.stats.last_seq is not None for stream in streams)


def served_by(router_url: str, worker_url: str) -> float:
    return metric(router_url, "kvserve_router_requests_total", {"worker": worker_url, "outcome": "ok"})


@pytest.mark.slow
def test_kv_events_index_is_rebuilt_after_a_worker_restart(chat_model_dir):  # noqa: F811
    argvs = [["--model", str(chat_model_dir), "--num-blocks", "128", *worker_events_argv("127.0.0.1")]
             for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        workers = list(pool.map(lambda argv: launch_server(argv, startup_timeout=120), argvs))
    urls = [w.url for w in workers]
    live = RouterThread(RouterConfig(workers=urls, policy="kv_events", poll_interval=0.2))
    blind = RouterThread(RouterConfig(workers=urls, policy="kv_events", poll_interval=60.0))
    try:
        with live, blind:
            index, blind_index = live.router.policy.index, blind.router.policy.index
            wait_for(lambda: synced(live.router.policy, 2) and synced(blind.router.policy, 2))
            # Warm PREFIX through the router; whichever worker got it is A.
            complete(live.url, PREFIX)
            wait_for(lambda: any(index.num_blocks(url) >= 4 for url in urls))
            a = next(i for i, url in enumerate(urls) if index.num_blocks(url) >= 4)
            a_url, b_url = urls[a], urls[1 - a]
            wait_for(lambda: blind_index.num_blocks(a_url) >= 4)  # the blind router reads the same events
            warm = complete(live.url, PREFIX + [70, 71])
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # routed back to A
            a_worker = next(w for w in live.router.pool.workers if w.url == a_url)
            generation, old_stream = a_worker.generation, live.router.policy.streams[a_worker]

            # Kill A while requests for its prefix are in flight there: none of them had started (unary),
            # so every one is retried on B.
            results: list[httpx.Response | None] = [None] * 4

            def send(i: int) -> None:
                results[i] = httpx.post(live.url + "/v1/completions", json=body(PREFIX + [80 + i], 200), timeout=60)

            threads = [threading.Thread(target=send, args=(i,)) for i in range(len(results))]
            for thread in threads:
                thread.start()
            wait_for(lambda: a_worker.in_flight > 0, timeout=20)
            workers[a].process.kill()
            workers[a].terminate()
            for thread in threads:
                thread.join(60)
            assert [r.status_code for r in results] == [200] * len(results)
            wait_for(lambda: not a_worker.healthy, timeout=10)
            assert index.num_blocks(a_url) == 0  # A left the pool: nothing is claimed for it
            before = served_by(live.url, b_url)
            for i in range(3):
                complete(live.url, PREFIX + [90 + i])
            assert served_by(live.url, b_url) == before + 3

            # Restart A: same port, same event endpoints, empty cache.
            workers[a] = launch_server(argvs[a], port=workers[a].port, startup_timeout=120)
            wait_for(lambda: a_worker.healthy and a_worker.generation == generation + 1, timeout=30)
            wait_for(lambda: synced(live.router.policy, 2))
            assert live.router.policy.streams[a_worker] is not old_stream  # a fresh subscription
            assert index.num_blocks(a_url) == 0
            # A's new process caches OTHER (sent to it directly); its events rebuild A's entries in both
            # routers, and the blind one first resets A's index when the sequence numbers start again.
            complete(a_url, OTHER)
            other = block_hashes(OTHER, 16, (), "sha256")
            wait_for(lambda: all(index.holds(a_url, h) for h in other), timeout=20)
            wait_for(lambda: all(blind_index.holds(a_url, h) for h in other), timeout=20)
            blind_stream = next(s for w, s in blind.router.policy.streams.items() if w.url == a_url)
            assert blind_stream.stats.resets >= 1
            prefix = block_hashes(PREFIX, 16, (), "sha256")
            assert not any(blind_index.holds(a_url, h) for h in prefix)  # the dead process's blocks are gone
            assert index.num_blocks(a_url) == blind_index.num_blocks(a_url) == len(other)
            # Routed back to A for the prompt it holds, by both routers.
            for router in (live, blind):
                before = served_by(router.url, a_url)
                again = complete(router.url, OTHER + [5, 6])
                assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
                assert served_by(router.url, a_url) == before + 1
    finally:
        for worker in workers:
            worker.terminate()
