"""Disaggregated serving end to end: a prefill worker and a decode worker (`python -m kvserve.server
--role ...`, tiny chat model, API keys, a real Redis as the shared store) behind a `--policy pd` router.

Greedy outputs through the hand-off equal a single mixed worker's, for radix and hash prefix caches,
for two tenants and a `cache_salt` (each its own namespace, so each its own hand-off), streamed or
not; the decode worker reports the prompt as cached from `remote`; a repeat is served warm by the
decode worker alone; afterwards neither worker holds a block. Faults: the prefill worker killed while
requests are in flight loses none of them (they are prefilled on the decode worker) and leaks nothing;
a decode worker whose store is unreachable makes the router fall back to mixed serving.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvserve.router.config import RouterConfig
from kvserve.router.thread import RouterThread
from kvserve.server.launcher import free_port, launch_server
from test_router_support import metric, write_keys
from test_server_support import chat_model_dir, wait_until_drained  # noqa: F401

MODEL = "tiny-chat"
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}
OPS = {"Authorization": "Bearer sk-ops"}
BLOCK = 16
GREEDY = {"temperature": 0, "ignore_eos": True}


def prompt(seed: int, length: int = 90) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(length)]


def body(tokens: list[int], max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "prompt": tokens, "max_tokens": max_tokens, **GREEDY, **extra}


def worker_args(model_dir: Path, keys: Path, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--num-blocks", "128", "--block-size", str(BLOCK), "--api-keys", str(keys),
            "--max-num-batched-tokens", "256", "--host-cache", "0", *extra]


def start(argvs: list[list[str]]):
    with ThreadPoolExecutor(len(argvs)) as pool:
        return list(pool.map(lambda argv: launch_server(argv, startup_timeout=120), argvs))


def post(url: str, payload: dict, headers: dict) -> dict:
    response = httpx.post(url + "/v1/completions", json=payload, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def streamed_text(url: str, payload: dict, headers: dict) -> str:
    with httpx.stream("POST", url + "/v1/completions", json={**payload, "stream": True}, headers=headers,
                      timeout=120) as response:
        assert response.status_code == 200
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return "".join(json.loads(line)["choices"][0]["text"] for line in lines[:-1])


def sources(answer: dict) -> dict[str, int]:
    """Where the decode worker found the prompt's cached tokens (the non-zero sources)."""
    by_source = answer["usage"]["prompt_tokens_details"]["cached_tokens_by_source"]
    return {source: tokens for source, tokens in by_source.items() if tokens}


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    return write_keys(tmp_path_factory.mktemp("disagg-keys"))


@pytest.fixture(scope="module")
def workers(chat_model_dir, keys, redis_server):  # noqa: F811
    """A mixed worker without a store (what the disaggregated path must reproduce) and, per prefix-cache
    mode, a prefill + decode pair on the shared Redis (started on first use; the fault test kills one)."""
    started: dict[str, tuple] = {}

    def get(mode: str):
        if mode not in started:
            roles = [["--prefix-cache", mode, "--remote-cache", redis_server.url, "--role", role]
                     for role in ("prefill", "decode")]
            argvs = [worker_args(chat_model_dir, keys, *extra) for extra in roles]
            if not started:
                argvs.append(worker_args(chat_model_dir, keys))
            processes = start(argvs)
            started[mode] = tuple(processes[:2])
            if len(processes) == 3:
                started["reference"] = (processes[2],)
        return started[mode]

    yield get
    for processes in started.values():
        for process in processes:
            process.terminate()


def pd_router(workers, model_dir: Path, keys: Path) -> RouterThread:
    config = RouterConfig(workers=[w.url for w in workers], policy="pd", model=str(model_dir), api_keys=str(keys),
                          poll_interval=0.2, pd_min_prompt=2 * BLOCK)
    return RouterThread(config)


@pytest.mark.parametrize("prefix_cache", ["radix", "hash"])
def test_handoff_outputs_equal_a_mixed_workers_and_come_from_the_store(
    prefix_cache, workers, chat_model_dir, keys, redis_url,  # noqa: F811
):
    prefill, decode = workers(prefix_cache)
    (reference,) = workers("reference")
    with pd_router([prefill, decode], chat_model_dir, keys) as router:
        tokens = prompt(1)
        cases = [(ALICE, {}), (BOB, {}), (ALICE, {"cache_salt": "s1"})]  # three namespaces: three hand-offs
        for headers, extra in cases:
            got = post(router.url, body(tokens, **extra), headers)
            want = post(reference.url, body(tokens, **extra), headers)
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert sources(got) == {"remote": len(tokens) // BLOCK * BLOCK}
        other = prompt(2)
        assert streamed_text(router.url, body(other), BOB) == post(reference.url, body(other), BOB)[
            "choices"][0]["text"]
        assert metric(router.url, "kvserve_router_pd_handoffs_total") == 4
        warm = post(router.url, body(tokens, max_tokens=4), ALICE)  # the decode worker holds it now
        assert sources(warm) == {"device": len(tokens) // BLOCK * BLOCK}
        assert metric(router.url, "kvserve_router_decisions_total", {"policy": "pd", "reason": "warm"}) == 1
        assert metric(router.url, "kvserve_router_pd_handoffs_total") == 4
        assert metric(router.url, "kvserve_router_pd_fallbacks_total") == 0
        assert metric(router.url, "kvserve_router_pd_handoff_bytes_total") > 0
    for worker in (prefill, decode):
        wait_until_drained(worker.url, OPS)


def test_prefill_worker_killed_mid_run_loses_no_request_and_leaks_nothing(
    workers, chat_model_dir, keys, redis_url,  # noqa: F811
):
    prefill, decode = workers("radix")
    (reference,) = workers("reference")
    with pd_router([prefill, decode], chat_model_dir, keys) as router:
        prompts = [prompt(10 + i, length=120) for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(post, router.url, body(tokens, max_tokens=12), ALICE) for tokens in prompts]
            prefill.process.kill()  # SIGKILL: no goodbye, connections drop
            answers = [future.result() for future in futures]
        for tokens, answer in zip(prompts, answers, strict=True):
            want = post(reference.url, body(tokens, max_tokens=12), ALICE)
            assert answer["choices"][0]["text"] == want["choices"][0]["text"]
        handed = metric(router.url, "kvserve_router_pd_handoffs_total")
        fell_back = metric(router.url, "kvserve_router_pd_fallbacks_total")
        assert fell_back >= 1 and handed + fell_back == len(prompts)
    wait_until_drained(decode.url, OPS)


def test_store_unreachable_from_the_decode_worker_falls_back_to_mixed(
    workers, chat_model_dir, keys, redis_url,  # noqa: F811
):
    """The decode worker's Redis is down (nothing listens there): its loads fail and its breaker opens;
    `/load` says so, and the router stops handing off (`store_down`) — every answer still right."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    prefill, decode = start([worker_args(chat_model_dir, keys, "--remote-cache", url, "--role", role)
                             for url, role in ((redis_url, "prefill"), (dead, "decode"))])
    (reference,) = workers("reference")
    try:
        with pd_router([prefill, decode], chat_model_dir, keys) as router:
            for i in range(10):
                tokens = prompt(50 + i)
                got = post(router.url, body(tokens), ALICE)
                assert got["choices"][0]["text"] == post(reference.url, body(tokens), ALICE)["choices"][0]["text"]
                assert "remote" not in sources(got)
                if metric(router.url, "kvserve_router_pd_fallbacks_total", {"reason": "store_down"}) >= 1:
                    break
                time.sleep(0.3)  # a poll of /load
            assert metric(router.url, "kvserve_router_pd_fallbacks_total", {"reason": "store_down"}) >= 1
        for worker in (prefill, decode):
            wait_until_drained(worker.url, OPS)
    finally:
        for worker in (prefill, decode):
            worker.terminate()
