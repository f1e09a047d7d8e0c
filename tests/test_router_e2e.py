"""The router end to end: two real `python -m kvserve.server` workers (tiny chat model with a real
tokenizer, API keys, KV events on) behind a router served from this process, over loopback.

Greedy outputs through the router equal a single worker's; SSE passes through chunk by chunk; a
conversation stays where its prefix is; tenant B's identical prompt is not steered by A's warm
replica; a client disconnect aborts the worker's request; KV events reach the router's subscriber;
and (last, it kills a worker) requests that had not started streaming survive a worker's death,
the router keeps serving, and the restarted worker rejoins with a fresh index.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvserve.router.config import RouterConfig
from kvserve.router.thread import RouterThread
from kvserve.server.launcher import launch_server
from test_router_support import metric, wait_for, write_keys
from test_server_support import chat_model_dir, wait_until_drained  # noqa: F401

MODEL = "tiny-chat"
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}
OPS = {"Authorization": "Bearer sk-ops"}
GREEDY = {"temperature": 0, "ignore_eos": True}
CHAT = "/v1/chat/completions"


def worker_args(model_dir: Path, keys: Path) -> list[str]:
    return ["--model", str(model_dir), "--num-blocks", "256", "--api-keys", str(keys),
            "--max-num-batched-tokens", "512"]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    return write_keys(tmp_path_factory.mktemp("router-keys"))


@pytest.fixture(scope="module")
def workers(chat_model_dir, keys):  # noqa: F811
    from kvserve.router.cluster import worker_events_argv

    argv = [[*worker_args(chat_model_dir, keys), *worker_events_argv("127.0.0.1")] for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda args: launch_server(args, startup_timeout=120), argv))
    yield started, argv
    for worker in started:
        worker.terminate()


@pytest.fixture(scope="module")
def router(workers, chat_model_dir, keys):  # noqa: F811
    processes, _ = workers
    config = RouterConfig(workers=[w.url for w in processes], model=str(chat_model_dir), api_keys=str(keys),
                          poll_interval=0.2)
    with RouterThread(config) as thread:
        yield thread


def chat_body(content: str, max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            **GREEDY, **extra}


def post(url: str, path: str, body: dict, headers: dict = ALICE) -> dict:
    response = httpx.post(url + path, json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def sse_events(url: str, path: str, body: dict, headers: dict = ALICE) -> list[str]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, headers=headers, timeout=120) as response:
        assert response.status_code == 200
        return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def streamed_text(events: list[str]) -> str:
    chunks = [json.loads(event) for event in events if event != "[DONE]"]
    return "".join(c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or ""
                   for c in chunks if c.get("choices"))


def test_greedy_outputs_through_the_router_equal_a_single_workers(router, workers):
    direct = workers[0][0].url
    for i, content in enumerate(["Hello there", "The quick brown fox", "How are you today?"]):
        body = chat_body(content, max_tokens=10, seed=i)
        assert (post(router.url, "/v1/chat/completions", body)["choices"]
                == post(direct, "/v1/chat/completions", body)["choices"])
    completion = {"model": MODEL, "prompt": [[5, 6, 7, 8, 9, 10], [11, 12, 13]], "max_tokens": 12, **GREEDY}
    assert post(router.url, "/v1/completions", completion)["choices"] == post(direct, "/v1/completions",
                                                                               completion)["choices"]


def test_streaming_passes_through_chunk_by_chunk(router, workers):
    body = chat_body("Stream this please", max_tokens=48)
    through = sse_events(router.url, "/v1/chat/completions", body)
    direct = sse_events(workers[0][0].url, "/v1/chat/completions", body)
    assert through[-1] == "[DONE]" and len(through) == len(direct) > 10
    assert streamed_text(through) == streamed_text(direct)
    assert streamed_text(through) == post(router.url, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    # Relayed as produced, not buffered: the first event arrives well before the last.
    arrivals = []
    with httpx.stream("POST", router.url + "/v1/chat/completions", json={**body, "stream": True},
                      headers={**ALICE, "X-Request-Id": "through-1"}, timeout=60) as response:
        assert response.headers["x-request-id"] == "chatcmpl-through-1"  # the caller's id, both ways
        for line in response.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.perf_counter())
    assert len(arrivals) == len(direct) and arrivals[-1] - arrivals[0] > 0.01


def test_a_conversation_stays_on_its_worker(router):
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly and politely."}]
    cached = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question number {turn}: the quick brown fox?"})
        reply = post(router.url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 6,
                                                          **GREEDY})
        cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    assert cached[0] == 0 and all(hits >= 16 for hits in cached[1:]), cached


def test_route_header_names_the_decision_and_pending_prefill_comes_back(router):
    """`x-kvserve-route` says where a request went and what was in flight there; the pending prefill the
    proxy counts for a request leaves its worker with the first token (streamed) or the answer (unary),
    and a request that fails at the worker (400) leaves nothing either."""
    prompt = list(range(40, 80))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **GREEDY}
    first = httpx.post(router.url + "/v1/completions", json=body, headers=ALICE, timeout=120)
    assert first.status_code == 200 and first.headers["x-request-id"] == first.json()["id"]
    route = dict(item.strip().split("=", 1) for item in first.headers["x-kvserve-route"].split(";"))
    assert route["prompt"] == "40" and route["ahead_requests"] == "0" and route["ahead_tokens"] == "0"
    again = sse_events(router.url, "/v1/completions", {**body, "prompt": prompt + [81, 82]})
    assert again[-1] == "[DONE]"
    with httpx.stream("POST", router.url + "/v1/completions", json={**body, "stream": True}, headers=ALICE,
                      timeout=120) as response:
        streamed = dict(item.strip().split("=", 1) for item in response.headers["x-kvserve-route"].split(";"))
        response.read()
    assert streamed["worker"] == route["worker"] and streamed["reason"] == "cache_hit"
    assert int(streamed["matched"]) >= 32
    bad = httpx.post(router.url + "/v1/completions", json={**body, "max_tokens": -1}, headers=ALICE, timeout=60)
    assert bad.status_code == 400
    for worker in router.router.pool.workers:
        assert worker.prefills == [] and worker.in_flight == 0, worker
    gauges = [line for line in httpx.get(router.url + "/metrics", headers=OPS).text.splitlines()
              if line.startswith("kvserve_router_worker_pending_prefill_tokens{")]
    assert len(gauges) == 2 and all(float(line.rsplit(" ", 1)[1]) == 0 for line in gauges), gauges


def test_tenant_b_is_not_steered_by_tenant_as_warm_replica(router):
    """B's identical prompt: no cache_hit decision, zero matched tokens, and a cold prefill -- the paired
    cross-tenant probe reads the same through the router as on one server. (Where B lands is left to the
    load / tree-size rule, which knows nothing of A's prompt.)"""
    body = chat_body("Paged attention stores keys and values in fixed-size blocks, tenant isolation test.")
    warm = post(router.url, "/v1/chat/completions", body, ALICE)
    hits_before = metric(router.url, "kvserve_router_decisions_total", {"reason": "cache_hit"})
    again = post(router.url, "/v1/chat/completions", body, ALICE)  # A again: a cache hit
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert metric(router.url, "kvserve_router_decisions_total", {"reason": "cache_hit"}) == hits_before + 1
    matched_before = metric(router.url, "kvserve_router_matched_tokens_total")
    bob = post(router.url, "/v1/chat/completions", body, BOB)
    assert bob["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert bob["choices"] == warm["choices"]
    assert metric(router.url, "kvserve_router_decisions_total", {"reason": "cache_hit"}) == hits_before + 1
    assert metric(router.url, "kvserve_router_matched_tokens_total") == matched_before


def test_an_idle_worker_copies_what_the_other_answered_for_the_same_tenant_only(router, workers):
    """Idle copies (router/idle_copy.py): once one worker answers a long prompt, the idle one computes it in the
    background, in the caller's namespace: A's same prompt sent there directly is a hit, B's is not, and the
    outputs equal the uncopied worker's."""
    prompt = [40 + i % 300 for i in range(200)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, **GREEDY}
    copies = metric(router.url, "kvserve_router_idle_copies_total", {"outcome": "ok"}, OPS)
    first = httpx.post(router.url + "/v1/completions", json=body, headers=ALICE, timeout=120)
    assert first.status_code == 200
    wait_for(lambda: metric(router.url, "kvserve_router_idle_copies_total", {"outcome": "ok"}, OPS) == copies + 1)
    answered = dict(item.strip().split("=", 1) for item in first.headers["x-kvserve-route"].split(";"))["worker"]
    other = next(w.url for w in workers[0] if w.url != answered)
    direct = post(other, "/v1/completions", body, ALICE)
    assert direct["usage"]["prompt_tokens_details"]["cached_tokens"] >= 192  # the copy's blocks, for A
    assert direct["choices"] == first.json()["choices"]
    assert post(other, "/v1/completions", body, BOB)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for url in (answered, other):
        wait_until_drained(url, OPS)


def test_client_disconnect_aborts_the_workers_request(router, workers):
    urls = [w.url for w in workers[0]]
    before = sum(_aborts(url) for url in urls)
    body = chat_body("Write a very long story", max_tokens=400)
    with httpx.stream("POST", router.url + "/v1/chat/completions", json={**body, "stream": True}, headers=ALICE,
                      timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    wait_for(lambda: sum(_aborts(url) for url in urls) == before + 1, timeout=20)
    for url in urls:
        wait_until_drained(url, OPS)


def _aborts(url: str) -> float:
    return metric(url, "kvserve_request_success_total", {"finished_reason": "abort"}, OPS)


def test_router_health_and_metrics(router, workers):
    health = httpx.get(router.url + "/health").json()  # open: load balancers probe it without a key
    assert health["status"] == "ok" and all(health["workers"].values()) and len(health["workers"]) == 2
    assert metric(router.url, "kvserve_router_worker_healthy") == 2
    assert metric(router.url, "kvserve_router_decisions_total", {"policy": "cache_aware"}) > 0
    assert metric(router.url, "kvserve_router_routing_seconds_count") > 0
    # With --api-keys the router's /metrics is admin-only, as the workers' is (it shows their traffic).
    assert httpx.get(router.url + "/metrics").status_code == 401
    assert httpx.get(router.url + "/metrics", headers=ALICE).status_code == 403
    assert httpx.get(router.url + "/metrics", headers=OPS).status_code == 200
    models = httpx.get(router.url + "/v1/models", headers=ALICE).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": [1]},
                      headers={"Authorization": "Bearer sk-wrong"}).status_code == 401  # the worker's answer
    worker = workers[0][0].url
    assert httpx.get(worker + "/load", headers=ALICE).status_code == 403  # load reveals traffic: admin only
    load = httpx.get(worker + "/load", headers=OPS).json()
    assert load["block_size"] == 16 and load["prefix_hash"] == "sha256" and load["kv_events_endpoint"]
    assert {"running", "waiting", "background", "kv_usage", "instance"} <= set(load)


def test_kv_events_keep_an_exact_index_and_route_by_it(workers, chat_model_dir, keys):  # noqa: F811
    processes, _ = workers
    config = RouterConfig(workers=[w.url for w in processes], model=str(chat_model_dir), api_keys=str(keys),
                          policy="kv_events", poll_interval=0.2)
    with RouterThread(config) as thread:
        policy = thread.router.policy
        wait_for(lambda: len(policy.streams) == 2 and all(
            s.stats.last_seq is not None for s in _streams(policy)), timeout=20)
        for worker in processes:  # start from empty caches: AllBlocksCleared / BlockRemoved reach the index
            assert httpx.post(worker.url + "/reset_prefix_cache", headers=OPS).status_code == 200
        wait_for(lambda: all(policy.index.num_blocks(w.url) == 0 for w in processes))
        prompt = list(range(3, 73))  # 70 tokens: 4 full blocks of 16
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **GREEDY}
        post(thread.url, "/v1/completions", body)
        wait_for(lambda: max(policy.index.num_blocks(w.url) for w in processes) >= 4)  # BlockStored arrived
        holder = next(w.url for w in processes if policy.index.num_blocks(w.url) >= 4)
        hits = metric(thread.url, "kvserve_router_decisions_total", {"reason": "cache_hit"})
        follow_up = post(thread.url, "/v1/completions", {**body, "prompt": prompt + [80, 81, 82]})
        assert follow_up["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
        assert metric(thread.url, "kvserve_router_decisions_total", {"reason": "cache_hit"}) == hits + 1
        assert metric(thread.url, "kvserve_router_matched_tokens_total", {"worker": holder}) >= 64
        # Tenant B, same tokens: other block hashes, so nothing in the index matches.
        matched = metric(thread.url, "kvserve_router_matched_tokens_total")
        bob = post(thread.url, "/v1/completions", body, BOB)
        assert bob["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(thread.url, "kvserve_router_matched_tokens_total") == matched
        assert httpx.post(holder + "/reset_prefix_cache", headers=OPS).status_code == 200
        wait_for(lambda: policy.index.num_blocks(holder) == 0)


def test_responses_continue_on_the_worker_that_holds_them(workers, chat_model_dir, keys):  # noqa: F811
    """round_robin alternates workers, and a worker keeps its responses in memory: without the router's
    affinity every continuation would land on the other worker and be a 404."""
    processes, _ = workers
    config = RouterConfig(workers=[w.url for w in processes], model=str(chat_model_dir), api_keys=str(keys),
                          policy="round_robin", poll_interval=0.2)
    body = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    with RouterThread(config) as thread:
        previous = post(thread.url, "/v1/responses", {**body, "input": "Hello, router."})
        history = [{"role": "user", "content": "Hello, router."}]
        for turn, stream in enumerate([False, True, False]):
            history += [{"role": "assistant", "content": previous["output"][0]["content"][0]["text"]},
                        {"role": "user", "content": f"Turn {turn}?"}]
            follow = {**body, "input": f"Turn {turn}?", "previous_response_id": previous["id"]}
            if stream:
                events = sse_events(thread.url, "/v1/responses", follow)
                previous = json.loads(events[-1])["response"]
            else:
                previous = post(thread.url, "/v1/responses", follow)
            assert previous["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the same worker's cache
            direct = post(thread.url, CHAT, {"model": MODEL, "messages": history, "max_tokens": 4, "temperature": 0})
            assert previous["output"][0]["content"][0]["text"] == direct["choices"][0]["message"]["content"]
        assert metric(thread.url, "kvserve_router_decisions_total", {"reason": "response_affinity"}) == 3
        stored = httpx.get(f"{thread.url}/v1/responses/{previous['id']}", headers=ALICE, timeout=30)
        assert stored.status_code == 200 and stored.json()["id"] == previous["id"]
        assert httpx.get(f"{thread.url}/v1/responses/{previous['id']}", headers=BOB).status_code == 404
        assert httpx.delete(f"{thread.url}/v1/responses/{previous['id']}", headers=ALICE).status_code == 200
        assert httpx.get(f"{thread.url}/v1/responses/{previous['id']}", headers=ALICE).status_code == 404


def _streams(policy):
    return list(policy.streams.values())


def _stream_of(policy, url):
    return next(stream for worker, stream in policy.streams.items() if worker.url == url)


@pytest.mark.slow
def test_worker_killed_mid_run_then_rejoins(router, workers, chat_model_dir, keys):  # noqa: F811
    processes, argv = workers
    victim, survivor = processes[1], processes[0]
    bodies = [chat_body(f"Long answer number {i}", max_tokens=150) for i in range(6)]
    expected = [post(survivor.url, "/v1/chat/completions", body)["choices"] for body in bodies]
    retries_before = metric(router.url, "kvserve_router_retries_total")
    results: list = [None] * len(bodies)

    def send(i: int) -> None:
        results[i] = httpx.post(router.url + "/v1/chat/completions", json=bodies[i], headers=ALICE, timeout=120)

    rr_config = RouterConfig(workers=[w.url for w in processes], model=str(chat_model_dir), api_keys=str(keys),
                             policy="round_robin", poll_interval=0.2)
    with RouterThread(rr_config) as rr, httpx.Client(timeout=120, headers=ALICE) as client:
        # Two streams through a round-robin router: one is running on each worker when the victim dies.
        streams = [client.stream("POST", rr.url + "/v1/chat/completions", json={**bodies[0], "stream": True})
                   for _ in range(2)]
        lines = [stream.__enter__().iter_lines() for stream in streams]
        assert all(next(it).startswith("data: ") for it in lines)
        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
        for thread in threads:
            thread.start()
        victim_worker = next(w for w in router.router.pool.workers if w.url == victim.url)
        wait_for(lambda: victim_worker.in_flight > 0, timeout=20)
        victim.process.kill()
        victim.terminate()
        tails = [[line for line in it if line.startswith("data: ")][-1] for it in lines]
        for stream in streams:
            stream.__exit__(None, None, None)
        for thread in threads:
            thread.join(120)
    # The stream on the victim ends with a clear error, the other one completes.
    assert sorted(tail == "data: [DONE]" for tail in tails) == [False, True]
    error = json.loads(next(tail for tail in tails if tail != "data: [DONE]")[len("data: "):])["error"]
    assert error["code"] == "worker_failed" and victim.url in error["message"]
    # No unary request had started streaming: every one was retried and succeeded, with the same output.
    assert [r.status_code for r in results] == [200] * len(bodies)
    assert [r.json()["choices"] for r in results] == expected
    assert metric(router.url, "kvserve_router_retries_total") > retries_before
    wait_for(lambda: not victim_worker.healthy, timeout=10)
    assert httpx.get(router.url + "/health").json()["workers"] == {survivor.url: True, victim.url: False}
    assert post(router.url, "/v1/chat/completions", chat_body("still serving"))["choices"]
    # Restart on the same port: it rejoins with a new generation and an empty tree.
    generation = victim_worker.generation
    processes[1] = launch_server(argv[1], port=victim.port, startup_timeout=120)
    wait_for(lambda: victim_worker.healthy and victim_worker.generation == generation + 1, timeout=30)
    assert router.router.policy.tree(victim_worker).num_tokens == 0
    assert all(httpx.get(router.url + "/health").json()["workers"].values())
