"""Routing over workers that share one KV store (router/policies/store.py): a worker can load what
another computed, at `fetch_cost` of computing it; for kv_events only blocks the index holds (published,
so written through) count, for cache_aware only prompts another worker has answered, never what is still
being computed; a worker with no store, another store, or an unreachable one gets no credit; another
tenant's blocks never count; and `/load` names the store by URL and model fingerprint."""

from __future__ import annotations

import time

import pytest

from kvserve.prefix.hashing import block_hashes
from kvserve.router.keys import RouteKey
from kvserve.router.policies import CacheAwarePolicy, CacheAwareSettings, KvEventsPolicy
from kvserve.router.policies.store import SharedStore
from kvserve.router.workers import PrefillStart, Worker, WorkerLoad
from kvserve.server.roles import RoleInfo

ALICE = ("alice", "")


def worker(name: str, store: str | None = "s1", tier: str | None = "ok") -> Worker:
    load = WorkerLoad(block_size=16, prefix_hash="sha256", remote_store=store, remote_tier=tier if store else None)
    return Worker(url=f"http://{name}", healthy=True, load=load)


def test_effective_counts_what_another_worker_of_the_same_store_published():
    a, b, c, d = worker("a"), worker("b"), worker("c", store="s2"), worker("d", tier="open")
    held = {a: 480, b: 0, c: 0, d: 0}
    store = SharedStore(fetch_cost=0.25)
    assert store.effective(held, held) == {a: 480, b: 360, c: 0, d: 0}
    assert store.effective(held, {a: 240, b: 0, c: 0, d: 0})[b] == 180  # only what a published
    assert store.effective({a: 480, b: 500, c: 0, d: 0}, held)[b] == 500  # holding more: nothing to load
    assert not SharedStore(fetch_cost=1.0).applies([a, b])
    assert not SharedStore().applies([worker("x", store=None), worker("y", store=None)])
    with pytest.raises(ValueError, match="store_fetch_cost"):
        SharedStore(fetch_cost=1.5)


def key(tokens: tuple[int, ...]) -> RouteKey:
    return RouteKey(tokens=tokens, namespace=ALICE, exact=True)


def busy_holder(policy: KvEventsPolicy) -> tuple[list[Worker], tuple[int, ...]]:
    """w0 holds a conversation's 752 tokens and computes two turns; w1 is idle and holds the shared
    512-token system prompt: a new turn of 992 tokens lacks 240 on w0 and 480 on w1."""
    pool = [worker("w0"), worker("w1")]
    tokens = tuple(range(512)) + tuple(range(1000, 1480))
    hashes = block_hashes(list(tokens), 16, ALICE, "sha256")
    policy.index.store(pool[0].url, hashes[:47])
    policy.index.store(pool[1].url, hashes[:32])
    pool[0].in_flight, pool[0].starts = 2, [PrefillStart(240), PrefillStart(240)]
    return pool, tokens


def route(policy: KvEventsPolicy, pool: list[Worker], tokens: tuple[int, ...]):
    return policy.choose(key(tokens), pool)


def test_a_turn_leaves_its_busy_worker_when_the_idle_one_can_load_its_history():
    """Store-blind (fetch cost 1): w0 240 + ⅔ × (480 + 64) = 603 against w1's 480 + 0: it moves and w1
    computes the history. Where w1 shares w0's store it moves as well, and loads the 240 history tokens
    (at 0.2: 48 of prefill) instead of computing them: 240 + 48 left to compute."""
    blind = KvEventsPolicy(balance_abs=8, store=SharedStore(fetch_cost=1.0))
    pool, tokens = busy_holder(blind)
    decision = route(blind, pool, tokens)
    assert decision.worker is pool[1] and decision.reason == "rebalance" and decision.matched_tokens == 512
    aware = KvEventsPolicy(balance_abs=8)
    pool, tokens = busy_holder(aware)
    decision = route(aware, pool, tokens)
    assert decision.worker is pool[1] and decision.reason == "shared_store" and decision.matched_tokens == 704


def test_a_store_makes_a_short_queue_worth_leaving():
    """One turn of 240 queued on w0: store-blind it stays (240 + ⅔ × 272 = 421 < 480); with the store the
    idle worker's 288 wins."""
    for fetch_cost, expected in ((1.0, 0), (0.2, 1)):
        policy = KvEventsPolicy(balance_abs=8, store=SharedStore(fetch_cost=fetch_cost))
        pool, tokens = busy_holder(policy)
        pool[0].in_flight, pool[0].starts = 1, [PrefillStart(240)]
        assert route(policy, pool, tokens).worker is pool[expected]


def test_blocks_still_being_computed_elsewhere_are_not_in_the_store():
    """w0 was just sent the conversation (pending, not reported stored): it counts as cached on w0, but
    not as loadable on w1, which gets the store-blind answer."""
    policy = KvEventsPolicy(balance_abs=8)
    pool, tokens = busy_holder(policy)
    hashes = block_hashes(list(tokens), 16, ALICE, "sha256")
    policy.index.clear(pool[0].url)
    policy.pending.add(pool[0].url, hashes[:47], now=time.monotonic())
    decision = route(policy, pool, tokens)
    assert decision.worker is pool[1] and decision.reason == "rebalance" and decision.matched_tokens == 512


def test_other_tenants_blocks_are_never_loadable():
    policy = KvEventsPolicy(balance_abs=8)
    pool, tokens = busy_holder(policy)
    bob = policy.choose(RouteKey(tokens=tokens, namespace=("bob", ""), exact=True), pool)
    assert bob.matched_tokens == 0 and bob.reason == "least_load"


class FakeRemote:
    url = "redis://10.0.0.5:6379/0"


class FakeFingerprint:
    def __init__(self, digest: str) -> None:
        self.digest = digest

    def hex(self) -> str:
        return self.digest


class FakeOffload:
    def __init__(self, url: str = FakeRemote.url, fingerprint: str = "ab" * 16) -> None:
        self.remote = FakeRemote()
        self.remote.url = url
        self.fingerprint = FakeFingerprint(fingerprint)


def test_load_names_the_store_by_url_and_model():
    assert RoleInfo("mixed").remote_store() is None
    one, same = RoleInfo("mixed", offload=FakeOffload()), RoleInfo("decode", offload=FakeOffload())
    assert one.remote_store() == same.remote_store() and len(one.remote_store()) == 16
    assert RoleInfo("mixed", offload=FakeOffload(url="redis://10.0.0.6:6379/0")).remote_store() != one.remote_store()
    assert RoleInfo("mixed", offload=FakeOffload(fingerprint="cd" * 16)).remote_store() != one.remote_store()
    assert WorkerLoad.from_json({"remote_store": one.remote_store(), "remote_tier": "ok"}).remote_store == \
        one.remote_store()


def cache_aware_holder(answered: bool) -> tuple[CacheAwarePolicy, list[Worker], RouteKey]:
    """cache_aware's view of the same turn: w0 was sent the conversation (and answered it, or not yet),
    w1 the system prompt; w0 computes two turns."""
    policy = CacheAwarePolicy(CacheAwareSettings(balance_abs=8))
    pool = [worker("w0"), worker("w1")]
    system, history = key(tuple(range(512))), key(tuple(range(512)) + tuple(range(1000, 1240)))
    for routed, at in ((system, pool[1]), (history, pool[0])):
        policy.on_routed(routed, at)
        if answered or at is pool[1]:
            policy.on_prefilled(routed, at)
    pool[0].in_flight, pool[0].starts = 2, [PrefillStart(240), PrefillStart(240)]
    return policy, pool, key(tuple(range(512)) + tuple(range(1000, 1480)))


def test_cache_aware_loads_only_what_another_worker_has_answered():
    policy, pool, turn = cache_aware_holder(answered=True)
    decision = policy.choose(turn, pool)
    assert decision.worker is pool[1] and decision.reason == "shared_store" and decision.matched_tokens == 704
    policy, pool, turn = cache_aware_holder(answered=False)  # w0 still computing it: not in the store yet
    decision = policy.choose(turn, pool)
    assert decision.worker is pool[1] and decision.reason == "rebalance" and decision.matched_tokens == 512


def test_cache_aware_without_a_store_keeps_no_answered_tree():
    policy = CacheAwarePolicy()
    plain = worker("p", store=None)
    policy.on_prefilled(key(tuple(range(64))), plain)
    assert policy.choose(key(tuple(range(64))), [plain, worker("q", store=None)]).reason != "shared_store"
    assert not policy._answered


def test_cluster_shared_store_starts_one_local_redis_unless_a_store_is_given():
    import redis

    from kvserve.cli import build_parser, engine_config_from_args
    from kvserve.router.cli import shared_store

    args = build_parser().parse_args(["cluster", "--replicas", "2", "--shared-store"])
    engine = engine_config_from_args(args)
    with shared_store(engine, args.shared_store) as with_store:
        assert with_store.remote_cache is not None and with_store.remote_cache.startswith("redis://127.0.0.1:")
        assert redis.Redis.from_url(with_store.remote_cache).ping()
        url = with_store.remote_cache
    with pytest.raises(redis.ConnectionError):  # stopped with the cluster
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
    given = engine_config_from_args(build_parser().parse_args(
        ["cluster", "--shared-store", "--remote-cache", "redis://10.0.0.9:6379/0"]))
    with shared_store(given, True) as kept:
        assert kept.remote_cache == "redis://10.0.0.9:6379/0"
    with shared_store(engine, False) as plain:
        assert plain.remote_cache is None


def test_decisions_tell_the_worker_whether_to_ask_the_store():
    """Over a store, kv_events' `store_probe` is True only where the chosen worker is expected to load
    (shared_store), False where the store holds nothing more than the worker (it stays with its history,
    or nobody has the prompt); None without a store, and from cache_aware. The router sends it as
    `x-kvserve-store-probe`."""
    from kvserve.server.roles import STORE_PROBE_HEADER, store_probe_wanted

    policy = KvEventsPolicy(balance_abs=8)
    pool, tokens = busy_holder(policy)
    assert route(policy, pool, tokens).store_probe is True  # moves to w1, which loads
    pool[0].in_flight, pool[0].starts = 0, []
    stays = route(policy, pool, tokens)
    assert stays.worker is pool[0] and stays.store_probe is False
    assert route(policy, pool, tuple(range(5000, 5100))).store_probe is False  # cached nowhere
    plain = KvEventsPolicy(balance_abs=8)
    bare = [worker("x", store=None), worker("y", store=None)]
    assert plain.choose(key(tuple(range(64))), bare).store_probe is None
    policy, pool, turn = cache_aware_holder(answered=True)
    assert policy.choose(turn, pool).store_probe is None  # cache_aware: its trees forget what the store holds
    assert store_probe_wanted({}) and store_probe_wanted({STORE_PROBE_HEADER: "1"})
    assert not store_probe_wanted({STORE_PROBE_HEADER: "0"})
