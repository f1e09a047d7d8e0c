"""OpenAI's `prompt_cache_key` through the router: requests with one key (in one tenant namespace) go where
the last of them went, unless that worker is too busy; other namespaces' keys never steer them."""

from __future__ import annotations

import asyncio

from kvserve.router.affinity import CacheKeyAffinity
from kvserve.router.workers import Worker
from test_router_inflight import request, setup

A, B = Worker(url="http://a", healthy=True), Worker(url="http://b", healthy=True)


def test_affinity_follows_the_key_within_a_namespace_and_yields_to_load():
    keys = CacheKeyAffinity(max_keys=2, slack=2)
    assert keys.worker("k", ("t1",), [A, B]) is None  # never seen: the policy decides
    keys.learn("k", ("t1",), B)
    assert keys.worker("k", ("t1",), [A, B]) is B
    assert keys.worker("k", ("t2",), [A, B]) is None  # another tenant's identical key
    assert keys.worker("k", ("t1",), [A]) is None  # its worker left the pool
    busy, idle = Worker(url="http://b", healthy=True, in_flight=3), Worker(url="http://a", healthy=True)
    assert keys.worker("k", ("t1",), [idle, busy]) is None  # 3 > 0 + 2: the policy decides
    busy.in_flight = 2
    assert keys.worker("k", ("t1",), [idle, busy]) is busy
    keys.learn("x", ("t1",), A)
    keys.learn("y", ("t1",), A)
    assert len(keys) == 2 and keys.worker("k", ("t1",), [A, B]) is None  # least recently used went
    assert keys.worker(5, ("t1",), [A, B]) is None and keys.worker("x", None, [A, B]) is None


def test_round_robin_keeps_one_keys_requests_on_one_worker():
    async def run() -> tuple[list[str], float]:
        router, fake = setup({"http://a": "ok", "http://b": "ok"})
        bodies = [{"prompt": "hi"}, {"prompt": "hi", "prompt_cache_key": "agent-7"},
                  {"prompt": "hi", "prompt_cache_key": "agent-7"}, {"prompt": "hi"},
                  {"prompt": "hi", "prompt_cache_key": "agent-7"},
                  {"prompt": "hi", "prompt_cache_key": "agent-7", "cache_salt": "other"}]
        for body in bodies:
            assert (await router.route(request(body), "/v1/completions")).status_code == 200
        followed = router.metrics.decisions.labels(router.policy.name, "cache_key_affinity")._value.get()
        return [url for url, _ in fake.seen], followed

    seen, followed = asyncio.run(run())
    keyed = [seen[i] for i in (1, 2, 4)]
    assert len(set(keyed)) == 1  # round_robin alone would alternate
    assert seen[0] != seen[1] and seen[3] != seen[2]  # unkeyed requests still alternate
    assert followed == 2  # requests 3 and 5; the other namespace's first request was the policy's choice
