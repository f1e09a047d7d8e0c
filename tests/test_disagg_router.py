"""The pd policy and the router's hand-off, with fake workers behind a mock transport (no processes):
the plan (hand-off, warm, short, store down, no prefill worker), the prefill body, and through a real
router served on loopback: the hand-off order and bodies, every fallback to mixed serving with its
metric, a caller error from the prefill worker, and a client leaving during the prefill."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.router.app import Router, build_router_app
from kvserve.router.handoff import prefill_body
from kvserve.router.keys import RequestKeyer, RouteKey
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies import CacheAwareSettings, PdPolicy
from kvserve.router.workers import Worker, WorkerLoad, WorkerPool
from kvserve.server.launcher import free_port
from kvserve.server.roles import FLUSH_BYTES_HEADER, FLUSH_HEADER, FLUSH_MS_HEADER
from test_router_support import metric, wait_for

NS = ("alice", "")
LONG = list(range(1, 301))


def worker(url: str, role: str, remote: str | None = "ok", running: int = 0) -> Worker:
    return Worker(url=url, healthy=True, load=WorkerLoad(role=role, remote_tier=remote, running=running,
                                                         block_size=16, prefix_hash="sha256"))


def key(tokens, namespace=NS) -> RouteKey:
    return RouteKey(tokens=tuple(tokens), namespace=namespace, exact=True)


# --- the plan --------------------------------------------------------------------------------------


def test_long_cold_prompt_is_handed_off_from_a_prefill_to_the_least_loaded_decode_worker():
    p, d1, d2 = worker("http://p", "prefill"), worker("http://d1", "decode", running=3), worker("http://d2", "decode")
    plan = PdPolicy(min_prompt_tokens=64).plan(key(LONG), [p, d1, d2])
    assert (plan.prefill, plan.decode, plan.reason) == (p, d2, "handoff")


def test_prompt_warm_on_a_decode_worker_skips_the_prefill_pool():
    p, d1, d2 = worker("http://p", "prefill"), worker("http://d1", "decode"), worker("http://d2", "decode", running=2)
    policy = PdPolicy(min_prompt_tokens=64)
    policy.on_routed(key(LONG), d2)  # d2 served this prompt before
    plan = policy.plan(key([*LONG, 7, 8]), [p, d1, d2])
    assert (plan.prefill, plan.decode, plan.reason) == (None, d2, "warm")
    assert plan.matched_tokens == len(LONG)
    other_tenant = policy.plan(key([*LONG, 7, 8], ("bob", "")), [p, d1, d2])
    assert other_tenant.reason == "handoff"  # bob's identical prompt is not warm anywhere


def test_short_prompts_store_down_and_no_prefill_worker_serve_mixed():
    p, d = worker("http://p", "prefill"), worker("http://d", "decode")
    policy = PdPolicy(min_prompt_tokens=64)
    assert policy.plan(key(range(1, 20)), [p, d]).reason == "short"
    down = worker("http://d", "decode", remote="open")
    assert (policy.plan(key(LONG), [p, down]).prefill, policy.plan(key(LONG), [p, down]).reason) == (None, "store_down")
    assert policy.plan(key(LONG), [worker("http://d", "decode", remote=None), p]).reason == "store_down"
    plan = policy.plan(key(LONG), [d])
    assert (plan.prefill, plan.decode, plan.reason) == (None, d, "no_prefill_worker")


def test_with_no_decode_worker_any_worker_serves_and_mixed_workers_decode():
    p1, p2 = worker("http://p1", "prefill"), worker("http://p2", "prefill")
    assert PdPolicy.decode_pool([p1, p2]) == [p1, p2]
    assert PdPolicy(min_prompt_tokens=64).plan(key(LONG), [p1, p2]).reason == "no_decode_worker"
    m = worker("http://m", "mixed")
    assert PdPolicy.decode_pool([p1, m]) == [m]
    assert PdPolicy().choose(key(LONG), [p1, m]).worker is m


def test_prefill_workers_are_chosen_cache_aware():
    p1, p2, d = worker("http://p1", "prefill"), worker("http://p2", "prefill"), worker("http://d", "decode")
    policy = PdPolicy(CacheAwareSettings(cache_threshold=0.5), min_prompt_tokens=64)
    policy.on_routed(key(LONG), p2)
    policy.on_routed(key(range(1000, 1100)), p1)
    assert policy.plan(key([*LONG, 5]), [p1, p2, d]).prefill is p2


def test_prefill_body_is_one_token_one_choice_unstreamed_and_otherwise_unchanged():
    original = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50,
                "stream": True, "stream_options": {"include_usage": True}, "n": 3, "min_tokens": 5,
                "cache_salt": "s1", "temperature": 0.7, "seed": 3}
    body = json.loads(prefill_body(original))
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                    "stream": False, "n": 1, "cache_salt": "s1", "temperature": 0.7, "seed": 3}


# --- through a router, with fake workers -------------------------------------------------------------


@dataclass
class FakeWorker:
    role: str
    remote_tier: str | None = "ok"
    flush: str = "ok"
    status: int = 200
    fail: bool = False  # the connection drops (the process died)
    hold: bool = False  # never answers (until the caller leaves)
    received: list[tuple[dict, str | None]] = field(default_factory=list)
    cancelled: int = 0

    async def answer(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/load", "/health"):
            return httpx.Response(200, json={"role": self.role, "remote_tier": self.remote_tier, "block_size": 16,
                                             "prefix_hash": "sha256", "status": "ok"})
        body = json.loads(request.content)
        self.received.append((body, request.headers.get("authorization")))
        if self.fail:
            raise httpx.RemoteProtocolError("server disconnected without sending a response")
        if self.hold:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "bad", "code": "bad"}})
        headers = {FLUSH_HEADER: self.flush, FLUSH_BYTES_HEADER: "4096", FLUSH_MS_HEADER: "1.5"} \
            if self.role == "prefill" else {}
        if body.get("stream"):
            chunks = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n',
                      b"data: [DONE]\n\n"]
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_aiter(chunks))
        return httpx.Response(200, json={"choices": [{"text": self.role}]}, headers=headers)


async def _aiter(chunks: list[bytes]):
    for chunk in chunks:
        yield chunk


class FakeCluster:
    """A router on loopback whose client reaches `fakes` (by URL) through a mock transport."""

    def __init__(self, fakes: dict[str, FakeWorker], min_prompt_tokens: int = 8) -> None:
        self.fakes = fakes

        async def handler(request: httpx.Request) -> httpx.Response:
            return await fakes[f"http://{request.url.host}"].answer(request)

        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        pool = WorkerPool(list(fakes), client, interval=0.1)
        self.router = Router(pool=pool, policy=PdPolicy(min_prompt_tokens=min_prompt_tokens),
                             keyer=RequestKeyer(None, None), client=client, metrics=RouterMetrics(lambda: pool.workers))
        port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(build_router_app(self.router), host="127.0.0.1", port=port,
                                                     log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> FakeCluster:
        self._thread.start()
        wait_for(lambda: self._server.started, timeout=20)
        wait_for(lambda: all(w.healthy for w in self.router.pool.workers), timeout=20)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(20)

    def post(self, body: dict, **kwargs) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-x"},
                          timeout=30, **kwargs)

    def fallbacks(self, reason: str) -> float:
        return metric(self.url, "kvserve_router_pd_fallbacks_total", {"reason": reason})


BODY = {"model": "m", "prompt": "a long enough prompt for a hand-off", "max_tokens": 20, "cache_salt": "s"}


@pytest.fixture
def fakes() -> dict[str, FakeWorker]:
    return {"http://prefill": FakeWorker("prefill"), "http://decode": FakeWorker("decode")}


def test_handoff_prefills_then_decodes_with_the_callers_key_and_body(fakes):
    with FakeCluster(fakes) as cluster:
        answer = cluster.post(BODY)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "decode"
        (prefill, prefill_auth), = fakes["http://prefill"].received
        (decode, decode_auth), = fakes["http://decode"].received
        assert prefill == {**BODY, "max_tokens": 1, "stream": False, "n": 1}
        assert decode == BODY and prefill_auth == decode_auth == "Bearer sk-x"
        assert metric(cluster.url, "kvserve_router_pd_handoffs_total") == 1
        assert metric(cluster.url, "kvserve_router_pd_handoff_bytes_total") == 4096
        streamed = {**BODY, "prompt": "another prompt, streamed this time", "stream": True}
        with httpx.stream("POST", cluster.url + "/v1/completions", json=streamed, timeout=30) as response:
            events = [line for line in response.iter_lines() if line]
        assert events[-1] == "data: [DONE]" and len(events) == 3
        assert fakes["http://prefill"].received[-1][0]["stream"] is False
        assert fakes["http://decode"].received[-1][0]["stream"] is True


@pytest.mark.parametrize(("change", "reason"), [
    ({"fail": True}, "prefill_failed"), ({"flush": "failed"}, "flush_failed"), ({"status": 429}, "prefill_error"),
])
def test_a_failed_prefill_falls_back_to_the_decode_worker(fakes, change, reason):
    for name, value in change.items():
        setattr(fakes["http://prefill"], name, value)
    with FakeCluster(fakes) as cluster:
        answer = cluster.post(BODY)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "decode"
        assert fakes["http://decode"].received[0][0] == BODY
        assert cluster.fallbacks(reason) == 1
        assert metric(cluster.url, "kvserve_router_pd_handoffs_total") == 0
        failed = metric(cluster.url, "kvserve_router_requests_total", {"worker": "http://prefill", "outcome": "failed"})
        assert failed == (1 if reason == "prefill_failed" else 0)  # a dead prefill worker leaves the pool
        assert all(w.in_flight == 0 for w in cluster.router.pool.workers)


def test_a_store_down_on_the_decode_worker_skips_the_prefill(fakes):
    fakes["http://decode"].remote_tier = "open"
    with FakeCluster(fakes) as cluster:
        assert cluster.post(BODY).status_code == 200
        assert fakes["http://prefill"].received == [] and len(fakes["http://decode"].received) == 1
        assert cluster.fallbacks("store_down") == 1


def test_a_caller_error_from_the_prefill_worker_is_the_answer(fakes):
    fakes["http://prefill"].status = 400
    with FakeCluster(fakes) as cluster:
        assert cluster.post(BODY).status_code == 400
        assert fakes["http://decode"].received == []


def test_a_client_leaving_during_the_prefill_cancels_it_and_never_decodes(fakes):
    fakes["http://prefill"].hold = True
    with FakeCluster(fakes) as cluster:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(cluster.url + "/v1/completions", json=BODY, timeout=1.0)
        wait_for(lambda: fakes["http://prefill"].cancelled == 1, timeout=10)
        time.sleep(0.2)
        assert fakes["http://decode"].received == []
        assert all(w.in_flight == 0 for w in cluster.router.pool.workers)


# --- the plan, by property -------------------------------------------------------------------------


@given(
    roles=st.lists(st.tuples(st.sampled_from(["prefill", "decode", "mixed"]), st.sampled_from(["ok", "open", None]),
                             st.integers(0, 20)), min_size=1, max_size=6),
    history=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=8),
    length=st.integers(0, 300), namespace=st.sampled_from([NS, ("bob", "")]),
)
@settings(max_examples=150, deadline=None)
def test_every_plan_respects_the_roles(roles, history, length, namespace):
    pool = [worker(f"http://w{i}", role, remote, running) for i, (role, remote, running) in enumerate(roles)]
    policy = PdPolicy(min_prompt_tokens=64)
    for index, prefix in history:  # earlier requests: prompts sharing 0-3 quarters of LONG
        policy.on_routed(key(LONG[: 75 * prefix + 10]), pool[index % len(pool)])
    plan = policy.plan(key(LONG[:length], namespace), pool)
    decoders = [w for w in pool if w.load.role != "prefill"] or pool
    assert plan.decode in decoders
    if plan.prefill is not None:
        assert plan.reason == "handoff" and plan.prefill.load.role == "prefill"
        assert plan.decode.load.remote_tier == "ok" and plan.decode.load.role != "prefill"
        assert length >= 64 or not key(LONG[:length]).usable
    if plan.reason != "warm":  # decode workers are chosen by load unless the prompt is warm there
        assert plan.decode.load_score == min(w.load_score for w in decoders)
    if not any(w.load.role == "prefill" for w in pool):
        assert plan.reason == "no_prefill_worker"
    if all(w.load.role == "prefill" for w in pool):
        assert plan.reason == "no_decode_worker"
