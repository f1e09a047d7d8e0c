"""The share guard's warm copy (`--warm-copy`): when the guard would move a request to a worker lacking its
prefix, the request stays where the policy sent it and a duplicate (one token, no stream, same tenant and
body) computes the prompt on the less served worker as a background request; nobody waits for it, it is
outside the router's load counts, and the policy indexes the prompt there once it is answered."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.requests import Request

from kvserve.router.app import Router, route_header
from kvserve.router.keys import RequestKeyer, RouteKey, namespace_marker
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies.base import Decision, Policy, ShareGuard
from kvserve.router.policies.cache_aware import CacheAwarePolicy, CacheAwareSettings
from kvserve.router.workers import Worker, WorkerLoad, WorkerPool
from kvserve.server.roles import BACKGROUND_HEADER
from test_router_inflight import request

PATH = "/v1/completions"


def workers(count: int) -> list[Worker]:
    return [Worker(url=f"http://w{i}", healthy=True, load=WorkerLoad(block_size=4, prefix_hash="sha256"))
            for i in range(count)]


def key(tokens: list[int]) -> RouteKey:
    return RouteKey(tokens=tuple(tokens), namespace=("alice", ""), exact=True)


def full_guard(pool: list[Worker], warm_copy: bool) -> ShareGuard:
    guard = ShareGuard(0.6, window=10, warm_copy=warm_copy)
    for _ in range(10):
        guard.add(pool[0])
    pool[0].in_flight, pool[1].in_flight = 3, 1  # w0 served every recent request and is busier: the guard acts
    return guard


def test_the_guard_keeps_the_request_and_copies_where_the_lighter_worker_lacks_the_prefix():
    pool = workers(2)
    chosen = Decision(pool[0], "cache_hit", 300)
    copied = full_guard(pool, warm_copy=True).apply(chosen, pool, {pool[0]: 300, pool[1]: 0}, 300)
    assert copied.worker is pool[0] and copied.reason == "cache_hit" and copied.copy_to is pool[1]
    moved = full_guard(pool, warm_copy=True).apply(chosen, pool, {pool[0]: 300, pool[1]: 300}, 300)
    assert moved.worker is pool[1] and moved.reason == "share" and moved.copy_to is None  # it holds it: no copy
    old = full_guard(pool, warm_copy=False).apply(chosen, pool, {pool[0]: 300, pool[1]: 0}, 300)
    assert old.worker is pool[1] and old.reason == "share" and old.copy_to is None  # without warm copies: moved
    assert ShareGuard(0.6, window=10, warm_copy=True).apply(chosen, pool, {pool[0]: 300, pool[1]: 0}, 300) is chosen


def test_with_both_workers_idle_the_guard_only_does_what_delays_nobody():
    """Onto an idle worker: a move when it holds as much of the prompt, or a warm copy short enough to be
    done before its next request (its prefill speed × the tokens it lacks within 2 × the mean gap between
    the router's requests); a long copy, or one with no speed known yet, is not made."""
    pool = workers(2)
    guard = ShareGuard(0.6, window=10, warm_copy=True, min_seen=4)
    for second in range(4):
        guard.add(pool[0], now=float(second))  # w0 served all 4, one a second; both idle now
    chosen = Decision(pool[0], "cache_hit", 512)
    moved = guard.apply(chosen, pool, {pool[0]: 512, pool[1]: 512}, 560)
    assert moved.worker is pool[1] and moved.reason == "share"
    assert guard.apply(chosen, pool, {pool[0]: 512, pool[1]: 0}, 560) is chosen  # no speed known yet
    pool[1].seconds_per_token = 0.003
    copied = guard.apply(chosen, pool, {pool[0]: 512, pool[1]: 0}, 560)  # 1.7 s within 2 x 1 s
    assert copied.worker is pool[0] and copied.copy_to is pool[1]
    long_prompt = guard.apply(Decision(pool[0], "cache_hit", 1520), pool, {pool[0]: 1520, pool[1]: 512}, 1760)
    assert long_prompt.copy_to is None and long_prompt.worker is pool[0]  # 1,248 tokens: 3.7 s, too long
    pool[0].in_flight = 1  # w0 busy, w1 idle: still no longer than w1's next request is likely away
    assert guard.apply(Decision(pool[0], "cache_hit", 1520), pool, {pool[0]: 1520, pool[1]: 512},
                       1760).copy_to is None
    pool[0].in_flight, pool[1].in_flight = 3, 1  # both busy, w1 less: the copy is made whatever its length
    assert guard.apply(Decision(pool[0], "cache_hit", 1520), pool, {pool[0]: 1520, pool[1]: 512},
                       1760).copy_to is pool[1]


def test_the_guard_copies_only_a_prefix_later_requests_will_use():
    """`popularity(n)`: the share of recent requests beginning with the prompt's first n tokens; the copy
    carries what the chosen worker holds. One user's conversation (1 of 64 recent requests) is not copied,
    a shared system prompt or a document (a quarter of them and more) is."""
    pool = workers(2)
    chosen = Decision(pool[0], "cache_hit", 1040)
    matches = {pool[0]: 1040, pool[1]: 512}
    asked: list[int] = []

    def share_of(fraction: float):
        def popularity(length: int) -> float:
            asked.append(length)
            return fraction
        return popularity

    assert full_guard(pool, warm_copy=True).apply(chosen, pool, matches, 1280, share_of(1 / 64)) is chosen
    assert asked == [1040]  # what the chosen worker holds: the copy would carry that
    copied = full_guard(pool, warm_copy=True).apply(chosen, pool, matches, 1280, share_of(0.25))
    assert copied.worker is pool[0] and copied.copy_to is pool[1]
    moved = full_guard(pool, warm_copy=True).apply(chosen, pool, {pool[0]: 1040, pool[1]: 1040}, 1280,
                                                    share_of(1 / 64))
    assert moved.worker is pool[1] and moved.reason == "share"  # a move copies nothing: not asked
    assert len(asked) == 2


def test_cache_aware_copies_the_shared_prefix_not_a_conversation():
    """Through the policy: 40 requests on w0, each a different conversation after one shared prefix. A new
    conversation's first turn (w1 lacks the shared prefix) gets a copy; a later turn of one conversation,
    which w1 lacks past the shared prefix, does not."""
    pool = workers(2)
    policy = CacheAwarePolicy(CacheAwareSettings(max_share=0.6, warm_copy=True))
    shared = list(range(100, 200))
    for user in range(40):
        policy.on_routed(key([*shared, *range(1000 + 1000 * user, 1100 + 1000 * user)]), pool[0])
    pool[0].in_flight, pool[1].in_flight = 3, 1
    first_turn = policy.choose(key([*shared, *range(700000, 700040)]), pool)
    assert first_turn.worker is pool[0] and first_turn.copy_to is pool[1]
    policy.on_copied(key(shared), pool[1])  # w1 holds the shared prefix now
    later_turn = policy.choose(key([*shared, *range(1000, 1100), *range(90000, 90040)]), pool)
    assert later_turn.worker is pool[0] and later_turn.copy_to is None


def test_cache_aware_indexes_the_copy_without_counting_it_as_routed():
    pool = workers(2)
    policy = CacheAwarePolicy(CacheAwareSettings(max_share=0.6, warm_copy=True))
    tokens = list(range(100, 400))
    for _ in range(40):
        policy.on_routed(key(tokens), pool[0])
    pool[0].in_flight, pool[1].in_flight = 3, 1
    decision = policy.choose(key(tokens), pool)
    assert decision.worker is pool[0] and decision.copy_to is pool[1]
    assert "copy=http://w1" in route_header(decision, key(tokens), pool)
    shares_before = policy.shares.share(pool[1])
    policy.on_copied(key(tokens), pool[1])
    marker = namespace_marker(("alice", ""))
    assert policy.tree(pool[1]).match([marker, *tokens]) == len(tokens) + 1  # indexed there
    assert policy.shares.share(pool[1]) == shares_before  # not counted as a request routed there
    after = policy.choose(key(tokens), pool)  # both hold it now: the less busy one takes it, no copy
    assert after.worker is pool[1] and after.copy_to is None


class Copying(Policy):
    """Sends everything to w0 with a warm copy to w1; records the copies it was told of."""

    name = "copying"

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.copied: list[str] = []
        self.prefilled: list[str] = []

    def choose(self, key: RouteKey, workers: list[Worker]) -> Decision:
        return Decision(self.pool.workers[0], "cache_hit", 0, copy_to=self.pool.workers[1])

    def on_copied(self, key: RouteKey, worker: Worker) -> None:
        self.copied.append(worker.url)

    def on_prefilled(self, key: RouteKey, worker: Worker) -> None:
        self.prefilled.append(worker.url)


def caller(body: dict) -> Request:
    return request(body, headers=((b"authorization", b"Bearer tenant-key"),))


def copying_router(fake) -> tuple[Router, WorkerPool, Copying]:
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake))
    pool = WorkerPool(["http://w0", "http://w1"], client)
    for worker in pool.workers:
        worker.healthy = True
    policy = Copying(pool)
    router = Router(pool=pool, policy=policy, keyer=RequestKeyer(None, None), client=client,
                    metrics=RouterMetrics(lambda: pool.workers))
    return router, pool, policy


@pytest.mark.parametrize("copy_fails", [False, True])
def test_the_copy_is_a_one_token_background_duplicate_answered_to_nobody(copy_fails):
    """The copy goes as a background request (the worker computes it only while nobody else's request
    waits or runs there), outside the router's load counts, one per worker at a time, indexed once it
    answered 200."""
    async def run() -> None:
        seen: list[tuple[str, dict, str | None, str | None]] = []
        release = asyncio.Event()

        async def fake(request: httpx.Request) -> httpx.Response:
            url = f"http://{request.url.host}"
            seen.append((url, json.loads(request.content), request.headers.get("authorization"),
                         request.headers.get(BACKGROUND_HEADER)))
            if url == "http://w1":
                await release.wait()
                if copy_fails:
                    raise httpx.ConnectError("refused", request=request)
                return httpx.Response(200, json={"choices": [{"text": "copy"}]})
            return httpx.Response(200, json={"choices": [{"text": "answer"}]})

        router, pool, policy = copying_router(fake)
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 50, "best_of": 2, "cache_salt": "s", "request_id": "mine"}
        response = await router.route(caller(body), PATH)
        assert b"answer" in response.body and b"copy" not in response.body  # the chosen worker's answer
        await asyncio.sleep(0)
        assert list(router.copies) == [pool.workers[1]] and policy.copied == []  # indexed only once answered
        assert pool.workers[1].in_flight == 0 and pool.workers[1].pending_prefill == 0  # not in w1's load
        await router.route(caller(dict(body, request_id="second")), PATH)
        await asyncio.sleep(0)
        assert [entry[0] for entry in seen].count("http://w1") == 1  # one copy in flight per worker
        release.set()
        await asyncio.gather(*router.copies.values())
        await asyncio.sleep(0)
        assert not router.copies and pool.workers[1].starts == []
        copy = next(entry for entry in seen if entry[0] == "http://w1")
        assert copy[1] == {"prompt": [5, 6, 7, 8], "max_tokens": 1, "stream": False, "n": 1, "cache_salt": "s"}
        assert copy[2] == "Bearer tenant-key" and copy[3] == "1"  # the tenant's key; a background request
        outcome = "failed" if copy_fails else "ok"
        sample = router.metrics.registry.get_sample_value("kvserve_router_warm_copies_total",
                                                          {"worker": "http://w1", "outcome": outcome})
        assert sample == 1
        assert policy.copied == ([] if copy_fails else ["http://w1"])
        assert policy.prefilled == ["http://w0", "http://w0"] + ([] if copy_fails else ["http://w1"])

    asyncio.run(run())


def test_a_responses_request_gets_no_copy():
    """A duplicate of a /v1/responses request would store a response nobody asked for."""
    async def run() -> None:
        urls: list[str] = []

        async def fake(request: httpx.Request) -> httpx.Response:
            urls.append(f"http://{request.url.host}")
            return httpx.Response(200, json={"id": "resp_1", "output": []})

        router, pool, policy = copying_router(fake)
        response = await router.route(caller({"input": "hi"}), "/v1/responses")
        await asyncio.sleep(0)
        assert response.status_code == 200 and urls == ["http://w0"] and not router.copies and policy.copied == []

    asyncio.run(run())
