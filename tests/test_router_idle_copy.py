"""Idle copies (router/idle_copy.py): once a worker answers a prompt, an idle worker lacking enough of it
gets the prompt as a background request (one token, the caller's tenant key, `x-kvserve-background`), kept
out of the router's load; the policy indexes it there once it answered 200. A client cannot set the
background header through the router."""

from __future__ import annotations

import asyncio
import json

import httpx

from kvserve.router.app import Router
from kvserve.router.idle_copy import IDLE_COPY_MIN_TOKENS, Answered, IdleCopies
from kvserve.router.keys import RequestKeyer, RouteKey
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies.cache_aware import CacheAwarePolicy
from kvserve.router.workers import Worker, WorkerLoad, WorkerPool
from kvserve.server.roles import BACKGROUND_HEADER
from test_router_inflight import request

PATH = "/v1/completions"
PROMPT = list(range(10, 10 + 2 * IDLE_COPY_MIN_TOKENS))


def key(tokens: list[int], tenant: str = "alice") -> RouteKey:
    return RouteKey(tokens=tuple(tokens), namespace=(tenant, ""), exact=True)


def idle_copies(policy: CacheAwarePolicy) -> IdleCopies:
    workers = [Worker(url="http://w0")]
    return IdleCopies(httpx.AsyncClient(), policy, RouterMetrics(lambda: workers))


def pool_of(count: int) -> list[Worker]:
    return [Worker(url=f"http://w{i}", healthy=True, load=WorkerLoad(block_size=4, prefix_hash="sha256"))
            for i in range(count)]


def answered(tokens: list[int], source: Worker, tenant: str = "alice") -> Answered:
    return Answered(key(tokens, tenant), PATH, b"{}", {}, {source})


def test_each_idle_worker_gets_the_newest_prompt_it_lacks_once():
    policy, pool = CacheAwarePolicy(), pool_of(3)
    copies = idle_copies(policy)
    older, newer = PROMPT, [9, *PROMPT]
    for tokens in (older, newer):
        policy.on_routed(key(tokens), pool[0])
        copies.recent.append(answered(tokens, pool[0]))
    assert copies.candidate(pool[1], pool).key == key(newer)  # the newest first
    assert copies.candidate(pool[0], pool) is None  # the source holds both
    policy.on_copied(key(newer), pool[1])
    assert copies.candidate(pool[1], pool).key == key(older)  # w1 holds the newer one now
    policy.on_routed(key(older[:-IDLE_COPY_MIN_TOKENS + 1]), pool[1])  # ... and all but a few tokens of the older
    assert copies.candidate(pool[1], pool) is None
    copies.recent[-1].tried.add(pool[2])  # tried on w2 already (say it failed there): not again
    assert copies.candidate(pool[2], pool).key == key(older)
    copies.recent.append(answered(PROMPT, pool[0], tenant="bob"))  # bob's copy of the same tokens: nobody has it
    assert copies.candidate(pool[1], pool).key == key(PROMPT, "bob")


def test_a_copy_goes_out_as_a_background_one_token_request_outside_the_routers_load():
    async def run() -> None:
        seen: list[tuple[str, dict, dict, int]] = []
        release = asyncio.Event()

        async def fake(sent: httpx.Request) -> httpx.Response:
            url = f"http://{sent.url.host}"
            worker = next(w for w in pool.workers if w.url == url)
            seen.append((url, json.loads(sent.content), dict(sent.headers), worker.in_flight))
            if url == "http://w1":
                await release.wait()
            return httpx.Response(200, json={"choices": [{"text": url}]})

        client = httpx.AsyncClient(transport=httpx.MockTransport(fake))
        pool = WorkerPool(["http://w0", "http://w1"], client)
        for worker in pool.workers:
            worker.healthy = True
        policy = CacheAwarePolicy()
        metrics = RouterMetrics(lambda: pool.workers)
        router = Router(pool=pool, policy=policy, keyer=RequestKeyer(None, None), client=client, metrics=metrics,
                        idle=IdleCopies(client, policy, metrics))
        body = {"prompt": PROMPT, "max_tokens": 20, "cache_salt": "s", "request_id": "mine"}
        caller = request(body, headers=((b"authorization", b"Bearer tenant-key"), (BACKGROUND_HEADER.encode(), b"1"),
                                        (b"x-request-id", b"mine")))
        response = await router.route(caller, PATH)
        assert response.status_code == 200
        answered = next(url for url, *_ in seen)
        other = next(w for w in pool.workers if w.url != answered)
        await asyncio.sleep(0)
        assert list(router.idle.in_flight) == [other] and other.in_flight == 0 and other.pending_prefill == 0
        release.set()
        await asyncio.gather(*router.idle.in_flight.values())
        first, copy = seen
        assert BACKGROUND_HEADER not in first[2]  # the client's header was dropped: only the router sets it
        assert copy[0] == other.url and copy[2][BACKGROUND_HEADER] == "1" and copy[3] == 0
        assert copy[2]["authorization"] == "Bearer tenant-key" and "x-request-id" not in copy[2]  # not the caller's id
        assert copy[1] == {"prompt": PROMPT, "max_tokens": 1, "stream": False, "n": 1, "cache_salt": "s"}
        sample = metrics.registry.get_sample_value("kvserve_router_idle_copies_total",
                                                   {"worker": other.url, "outcome": "ok"})
        assert sample == 1
        keyed = await asyncio.to_thread(router.keyer.key, PATH, body, "Bearer tenant-key")
        held = policy.held_by(keyed, pool.workers)
        assert held is not None and held[other] >= len(PROMPT) - 1  # indexed there once it answered
        await client.aclose()

    asyncio.run(run())


def test_a_worker_busy_when_the_prompt_was_answered_gets_it_once_idle():
    async def run() -> None:
        urls: list[str] = []

        async def fake(sent: httpx.Request) -> httpx.Response:
            urls.append(f"http://{sent.url.host}")
            return httpx.Response(200, json={"choices": [{"text": "x"}]})

        client = httpx.AsyncClient(transport=httpx.MockTransport(fake))
        pool = WorkerPool(["http://w0", "http://w1"], client)
        for worker in pool.workers:
            worker.healthy = True
            worker.load = WorkerLoad(running=2)  # someone else's requests on both
        policy = CacheAwarePolicy()
        metrics = RouterMetrics(lambda: pool.workers)
        router = Router(pool=pool, policy=policy, keyer=RequestKeyer(None, None), client=client, metrics=metrics,
                        idle=IdleCopies(client, policy, metrics))
        response = await router.route(request({"prompt": PROMPT, "max_tokens": 5}), PATH)
        await asyncio.sleep(0)
        assert response.status_code == 200 and len(urls) == 1 and not router.idle.in_flight
        answered_by = urls[0]
        for worker in pool.workers:
            worker.load = WorkerLoad()  # both idle at the next poll: the one that lacks the prompt gets it
        router.idle.pump(pool.healthy())
        await asyncio.gather(*router.idle.in_flight.values())
        assert len(urls) == 2 and urls[1] != answered_by
        router.idle.pump(pool.healthy())
        assert not router.idle.in_flight  # copied once: nothing more to send
        await client.aclose()

    asyncio.run(run())


def test_workers_sharing_the_cores_copy_only_while_a_core_is_idle():
    """`idle_copy_slots` (kvserve cluster: cores over each worker's threads): with 2 slots and one worker busy,
    one copy starts, not two: a third computing worker would take a core from the busy one."""
    async def run() -> None:
        release = asyncio.Event()

        async def fake(sent: httpx.Request) -> httpx.Response:
            await release.wait()
            return httpx.Response(200, json={"choices": [{"text": "x"}]})

        client = httpx.AsyncClient(transport=httpx.MockTransport(fake))
        policy, pool = CacheAwarePolicy(), pool_of(3)
        copies = IdleCopies(client, policy, RouterMetrics(lambda: pool), slots=2)
        policy.on_routed(key(PROMPT), pool[0])
        copies.recent.append(answered(PROMPT, pool[0]))
        pool[0].in_flight = 1
        copies.pump(pool)
        assert list(copies.in_flight) == [pool[1]]
        unlimited = IdleCopies(client, policy, RouterMetrics(lambda: pool))
        unlimited.recent.append(answered(PROMPT, pool[0]))
        unlimited.pump(pool)
        assert list(unlimited.in_flight) == [pool[1], pool[2]]  # every worker on its own hardware
        release.set()
        await asyncio.gather(*copies.in_flight.values(), *unlimited.in_flight.values())
        await client.aclose()

    asyncio.run(run())
