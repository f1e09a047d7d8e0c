"""Router policies and indexes, without processes: the token tree (by property against a brute-force
model), SGLang's cache_aware rule, tenant isolation of every routing key, least_load, round_robin,
the exact block index and the kv_events policy."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.events.format import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvserve.prefix.hashing import block_hashes
from kvserve.router.config import RouterConfig
from kvserve.router.index import BlockIndex
from kvserve.router.keys import RequestKeyer, RouteKey
from kvserve.router.policies import (
    CacheAwarePolicy,
    CacheAwareSettings,
    KvEventsPolicy,
    LeastLoadPolicy,
    RoundRobinPolicy,
)
from kvserve.router.policies.base import ShareGuard
from kvserve.router.policies.eta import EtaCost
from kvserve.router.radix import TokenTree
from kvserve.router.workers import PrefillStart, Worker, WorkerLoad
from kvserve.server.auth import load_api_keys

ALICE, BOB = ("alice", ""), ("bob", "")



def pending(tokens: list[int]) -> list[PrefillStart]:
    """Requests in flight on a worker, not answered yet, by their uncached prompt tokens (sent now)."""
    return [PrefillStart(count) for count in tokens]


def workers(count: int, block_size: int = 4) -> list[Worker]:
    return [Worker(url=f"http://w{i}", healthy=True, load=WorkerLoad(block_size=block_size, prefix_hash="sha256"))
            for i in range(count)]


def key(tokens, namespace=ALICE) -> RouteKey:
    return RouteKey(tokens=tuple(tokens), namespace=namespace, exact=True)


# --- token tree ------------------------------------------------------------------------------------


def test_tree_matches_longest_prefix_and_splits_edges():
    tree = TokenTree(budget=1000)
    tree.insert([1, 2, 3, 4, 5])
    tree.insert([1, 2, 9])
    assert tree.match([1, 2, 3, 4, 5, 6]) == 5
    assert tree.match([1, 2, 9, 9]) == 3
    assert tree.match([1, 2]) == 2
    assert tree.match([7]) == 0
    assert tree.num_tokens == 6
    tree.check_invariants()


def test_tree_evicts_least_recently_used_to_budget():
    tree = TokenTree(budget=10)
    tree.insert([1] * 6)
    tree.insert([2] * 6)  # 12 > 10: the older [1]*6 goes
    tree.check_invariants()
    assert tree.num_tokens <= 10
    assert tree.match([2] * 6) == 6 and tree.match([1] * 6) == 0


sequences = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=25)


@settings(max_examples=80, deadline=None)
@given(sequences, st.lists(st.integers(0, 3), max_size=12))
def test_tree_match_equals_brute_force_without_eviction(inserted, probe):
    tree = TokenTree(budget=10_000)
    for seq in inserted:
        tree.insert(seq)
    tree.check_invariants()
    expected = max(_common_prefix(seq, probe) for seq in inserted)
    assert tree.match(probe) == expected
    assert tree.num_tokens <= sum(map(len, inserted))


@settings(max_examples=80, deadline=None)
@given(sequences, st.integers(8, 40))
def test_tree_under_budget_keeps_invariants_and_the_latest_insert(inserted, budget):
    tree = TokenTree(budget=budget)
    for seq in inserted:
        tree.insert(seq)
        tree.check_invariants()
        # The newest sequence survives its own eviction whenever it fits in the low-water mark.
        if len(seq) <= int(budget * 0.9):
            assert tree.match(seq) == len(seq)
        assert tree.match(seq) <= len(seq)


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# --- cache_aware -------------------------------------------------------------------------------------


def test_cache_aware_sends_a_prefix_back_where_it_went():
    policy, pool = CacheAwarePolicy(), workers(3)
    conversation = list(range(100, 164))
    first = policy.choose(key(conversation), pool)
    policy.on_routed(key(conversation), first.worker)
    follow_up = policy.choose(key(conversation + [7, 8, 9, 10]), pool)
    assert follow_up.worker is first.worker and follow_up.reason == "cache_hit"
    assert follow_up.matched_tokens == len(conversation)


@pytest.mark.parametrize("estimate", ["requests", "eta"])
def test_cache_aware_spreads_new_prefixes_by_tree_size(estimate):
    policy, pool = CacheAwarePolicy(CacheAwareSettings(load_estimate=estimate)), workers(2)
    chosen = []
    for i in range(6):
        prompt = key([1000 + i] * 32)
        decision = policy.choose(prompt, pool)
        assert decision.reason == "smallest_tree"
        policy.on_routed(prompt, decision.worker)
        chosen.append(decision.worker)
    assert chosen.count(pool[0]) == chosen.count(pool[1]) == 3


def test_cache_aware_ignores_affinity_when_imbalanced():
    """SGLang's rule as the issue states it (load_estimate="requests")."""
    settings = CacheAwareSettings(balance_abs=4, balance_rel=1.5, load_estimate="requests")
    policy, pool = CacheAwarePolicy(settings), workers(2)
    prompt = key(range(64))
    policy.on_routed(prompt, pool[0])
    pool[0].in_flight = 10  # 10 − 0 > 4 and 10 > 1.5 × 0
    decision = policy.choose(prompt, pool)
    assert decision.worker is pool[1] and decision.reason == "imbalance"
    pool[0].in_flight = 3  # within the absolute threshold: affinity wins
    assert policy.choose(prompt, pool).worker is pool[0]


@pytest.mark.parametrize("make", [CacheAwarePolicy, KvEventsPolicy])
def test_imbalance_guard_sends_a_new_prefix_to_the_emptiest_idle_worker(make):
    """Imbalanced with two idle workers: a prompt cached nowhere goes to the one holding nothing yet, every
    time (the rotation alone sent a 4th document beside another one, and one of 4 workers idled all run);
    a prompt cached somewhere still rotates over the tie as before."""
    policy, pool = make(), workers(3)
    held = list(range(5000, 5256))
    policy.on_routed(key(held), pool[1])
    if isinstance(policy, KvEventsPolicy):
        hashes = block_hashes(held, 4, ALICE, "sha256")
        policy.index.apply(pool[1].url, KVEventBatch(ts=0.0, events=[BlockStored(hashes, None, [], 4)]))
    pool[0].in_flight = 3  # 3 − 0 > 2 and 3 > 1.5 × 0: imbalanced; w1 and w2 idle
    for fresh in range(4):
        decision = policy.choose(key(range(100 * fresh + 10_000, 100 * fresh + 10_300)), pool)
        assert decision.worker is pool[2] and decision.reason == "imbalance"


@pytest.mark.parametrize("make", [CacheAwarePolicy, KvEventsPolicy])
def test_imbalance_guard_copies_only_a_hot_prefix(make):
    """4 workers, each holding one of 4 equally asked documents: the one busy with 3 requests for its
    document keeps the 4th (copying a cold document costs its whole prefill to save one wait); once that
    document is asked 16 times in the last 28 it is hot and copied to an idle worker. The old guard, on
    request counts alone, copied both."""
    policy, pool = make(), workers(4)
    docs = [list(range(1000 * d, 1000 * d + 256)) for d in range(1, 5)]

    def route(prompt, worker):
        policy.on_routed(key(prompt), worker)
        if isinstance(policy, KvEventsPolicy):
            hashes = block_hashes(prompt, 4, ALICE, "sha256")
            policy.index.apply(worker.url, KVEventBatch(ts=0.0, events=[BlockStored(hashes, None, [], 4)]))

    for round_ in range(4):
        for doc, worker in zip(docs, pool, strict=True):
            route(doc + [round_], worker)
    pool[0].in_flight, pool[1].in_flight = 3, 1  # 3 − 0 > 2 and 3 > 1.5 × 0: imbalanced
    cold = policy.choose(key(docs[0] + [99]), pool)
    assert cold.worker is pool[0] and cold.reason == "cache_hit"
    for round_ in range(12):
        route(docs[0] + [200 + round_], pool[0])
    hot = policy.choose(key(docs[0] + [98]), pool)
    assert hot.worker in (pool[2], pool[3]) and hot.reason == "imbalance"


def test_cache_aware_threshold_fraction():
    policy, pool = CacheAwarePolicy(CacheAwareSettings(cache_threshold=0.5, load_estimate="requests")), workers(2)
    policy.on_routed(key(range(10)), pool[0])
    policy.on_routed(key([999] * 40), pool[1])  # pool[1] has the bigger tree
    assert policy.choose(key(range(30)), pool).reason == "smallest_tree"  # 10/30 matched: not enough
    assert policy.choose(key(range(15)), pool).worker is pool[0]  # 10/15 > 0.5


def test_cache_aware_never_matches_across_tenants():
    """Tenant B's identical prompt finds nothing in the tree that A's prompt warmed."""
    policy, pool = CacheAwarePolicy(), workers(2)
    prompt = list(range(200, 264))
    first = policy.choose(key(prompt, ALICE), pool)
    policy.on_routed(key(prompt, ALICE), first.worker)
    decision = policy.choose(key(prompt, BOB), pool)
    assert decision.reason == "smallest_tree" and decision.matched_tokens == 0
    assert decision.worker is not first.worker  # the cold one: A's warm replica is not B's
    # cache_salt splits namespaces the same way within one tenant
    assert policy.choose(key(prompt, ("alice", "salt")), pool).matched_tokens == 0


def test_cache_aware_tree_holds_no_more_than_its_workers_kv_pool():
    """A tree that outlived the worker's evictions predicts hits that are gone: bounded by num_blocks ×
    block_size from `/load` (the configured budget when that is smaller, or unknown)."""
    policy, pool = CacheAwarePolicy(CacheAwareSettings(tree_budget=1000)), workers(2)
    pool[0].load.num_blocks = 8  # 32 tokens
    for start in range(0, 400, 20):
        policy.on_routed(key(range(start, start + 20)), pool[0])
        policy.on_routed(key(range(start, start + 20)), pool[1])
    assert policy.tree(pool[0]).num_tokens <= 32
    assert 32 < policy.tree(pool[1]).num_tokens <= 1000
    assert policy.choose(key(range(0, 20)), [pool[0]]).matched_tokens == 0  # evicted long ago
    pool[1].load.num_blocks = 4  # learned later (or the worker shrank): the tree shrinks at once
    assert policy.tree(pool[1]).num_tokens <= 16


def test_rejoined_worker_starts_with_an_empty_tree():
    policy, pool = CacheAwarePolicy(), workers(2)
    policy.on_routed(key(range(64)), pool[0])
    policy.on_join(pool[0])
    assert policy.tree(pool[0]).num_tokens == 0


# --- least_load, round_robin ----------------------------------------------------------------------------


def test_least_load_picks_the_least_loaded_and_rotates_ties():
    policy, pool = LeastLoadPolicy(), workers(3)
    pool[0].polled(WorkerLoad(running=2), 0, 0)  # requests from elsewhere, as polled
    pool[1].polled(WorkerLoad(waiting=1), 0, 0)
    assert policy.choose(key([1]), pool).worker is pool[2]
    pool[2].in_flight = 5
    assert policy.choose(key([1]), pool).worker is pool[1]
    idle = workers(2)
    assert {policy.choose(key([1]), idle).worker.url for _ in range(4)} == {"http://w0", "http://w1"}


def test_round_robin_cycles():
    policy, pool = RoundRobinPolicy(), workers(3)
    assert [policy.choose(key([1]), pool).worker.url for _ in range(6)] == [w.url for w in pool] * 2


# --- the exact index and kv_events -----------------------------------------------------------------------


def stored(hashes, tokens=(), parent=None) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[BlockStored(list(hashes), parent, list(tokens), 4)])


def test_block_index_runs_stop_at_the_first_hole():
    index = BlockIndex()
    h = [bytes([i]) * 32 for i in range(5)]
    index.apply("a", stored(h[:3]))
    index.apply("b", stored([h[0], h[2], h[3]]))
    assert index.longest_runs(h, ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    index.apply("a", KVEventBatch(ts=0.0, events=[BlockRemoved([h[1]])]))
    assert index.longest_runs(h, ["a"]) == {"a": 1}
    index.apply("b", KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    assert index.num_blocks("b") == 0 and index.longest_runs(h, ["b"]) == {"b": 0}
    index.check_invariants()


def test_kv_events_policy_follows_the_index_within_the_tenant():
    policy, pool = KvEventsPolicy(), workers(2, block_size=4)
    tokens = list(range(50, 70))  # 5 full blocks
    hashes = block_hashes(tokens, 4, ALICE, "sha256")
    policy.index.store(pool[1].url, hashes[:4])
    decision = policy.choose(key(tokens), pool)
    assert decision.worker is pool[1] and decision.reason == "cache_hit" and decision.matched_tokens == 16
    bob = policy.choose(key(tokens, BOB), pool)  # same tokens, other tenant: other hashes
    assert bob.matched_tokens == 0 and bob.reason == "least_load"


def test_kv_events_policy_weighs_queued_prefill_against_cached_blocks():
    """eta = uncached tokens + load_weight × (Σ min(pending prefill, uncached) + overhead × in flight)."""
    policy, pool = KvEventsPolicy(EtaCost(load_weight=1.0, request_overhead=0.0), balance_abs=8), workers(2)
    tokens = list(range(16))
    hashes = block_hashes(tokens, 4, ALICE, "sha256")
    policy.index.store(pool[0].url, hashes[:1])  # 4 tokens cached on w0 only: 12 uncached there
    pool[0].in_flight, pool[0].starts = 1, pending([24])  # 12 + min(24, 12) > 16 + 0
    decision = policy.choose(key(tokens), pool)
    assert decision.worker is pool[1] and decision.reason == "rebalance" and decision.matched_tokens == 0
    pool[0].starts = pending([2])  # 12 + 2 < 16
    decision = policy.choose(key(tokens), pool)
    assert decision.worker is pool[0] and decision.reason == "cache_hit" and decision.matched_tokens == 4
    pool[0].starts = pending([24])
    pool[1].in_flight, pool[1].starts = 1, pending([24])  # 12 + 12 < 16 + 16: the other worker is busy too
    assert policy.choose(key(tokens), pool).worker is pool[0]
    pool[0].in_flight = 3  # 3 − 1 > balance_abs 1 and 3 > 1.5 × 1: SGLang's guard, before any score
    assert KvEventsPolicy(balance_abs=1).choose(key(tokens), pool).reason == "imbalance"


def chat_turn(policy: KvEventsPolicy, pool: list[Worker]) -> RouteKey:
    """A turn at the benchmark's sizes (blocks of 16): both workers hold the shared 512-token system
    prompt, w0 also the conversation's previous prompt (240 tokens); the reply carried into the history
    (192) and the new question (48) are new. Uncached: 240 on w0, 480 on w1."""
    system, previous, new = list(range(512)), list(range(1000, 1240)), list(range(2000, 2240))
    tokens = system + previous + new
    hashes = block_hashes(tokens, 16, ALICE, "sha256")
    policy.index.store(pool[0].url, hashes[:47])  # system + previous prompt
    policy.index.store(pool[1].url, hashes[:32])  # system only
    return key(tokens)


def test_kv_events_policy_moves_a_conversation_only_when_its_queue_outweighs_its_history():
    """Defaults (load_weight 2/3, 32 tokens per request in flight)."""
    policy, pool = KvEventsPolicy(balance_abs=8), workers(2, block_size=16)
    turn = chat_turn(policy, pool)
    pool[0].in_flight, pool[0].starts = 2, pending([240, 240])  # 240 + ⅔ × (480 + 64) = 603
    pool[1].in_flight, pool[1].starts = 1, pending([240])  # 480 + ⅔ × (240 + 32) = 661
    decision = policy.choose(turn, pool)
    assert decision.worker is pool[0] and decision.reason == "cache_hit" and decision.matched_tokens == 752
    pool[1].in_flight, pool[1].starts = 0, pending([])
    pool[0].in_flight, pool[0].starts = 3, pending([240, 240, 240])  # 240 + ⅔ × (720 + 96) = 784 > 480: w1 idles
    decision = policy.choose(turn, pool)
    assert decision.worker is pool[1] and decision.reason == "rebalance" and decision.matched_tokens == 512
    pool[0].starts = pending([48, 48, 48])  # as many requests, short ones: 240 + ⅔ × (144 + 96) = 400 < 480
    assert policy.choose(turn, pool).worker is pool[0]


def test_kv_events_policy_load_weight_prices_a_copy():
    """The first case above at load_weight 1: 240 + 544 > 480 + 272, the turn moves (and copies its
    history) where at ⅔ it waits."""
    policy, pool = KvEventsPolicy(EtaCost(load_weight=1.0), balance_abs=8), workers(2, block_size=16)
    turn = chat_turn(policy, pool)
    pool[0].in_flight, pool[0].starts = 2, pending([240, 240])
    pool[1].in_flight, pool[1].starts = 1, pending([240])
    assert policy.choose(turn, pool).worker is pool[1]


def send(policy, worker: Worker, tokens: list[int]) -> None:
    """What the proxy does when it sends a request: the policy's index, then the worker's queue."""
    decision = policy.choose(key(tokens), [worker])
    policy.on_routed(key(tokens), worker)
    worker.in_flight += 1
    worker.starts.append(PrefillStart(decision.uncached(key(tokens))))


@pytest.mark.parametrize("make", [lambda: KvEventsPolicy(), lambda: CacheAwarePolicy()])
def test_a_request_waits_for_all_prefill_queued_ahead(make):
    """A worker answers a request after the prefill queued ahead of it, not beside it: measured, a
    48-token question (its prefix cached) took 0.13 s alone and 2.2 s sent 0.1 s after an unrelated
    1,072-token read (which took 2.2 s). One read ahead: 48 + ⅔ × (1,072 + 32) = 784 < 1,072 on the
    idle w1, the question stays with its document. Two reads ahead: 48 + ⅔ × (2,144 + 64) > 1,072, it
    is read again on w1 (processor sharing, Σ min(p, 48), priced the wait at 96 tokens and kept it
    queued while w1 idled). Once the oldest read is mostly done, by the speed seen on w0, it stays."""
    doc, other, question = list(range(5000, 6024)), list(range(10000, 11024)), list(range(7000, 7048))
    policy, pool = make(), workers(2, block_size=16)
    send(policy, pool[0], doc + list(range(8000, 8048)))
    decision = policy.choose(key(doc + question), pool)
    assert decision.worker is pool[0] and decision.matched_tokens == 1024
    send(policy, pool[0], other + list(range(8000, 8048)))
    decision = policy.choose(key(doc + question), pool)
    assert decision.worker is pool[1] and decision.reason == "rebalance"
    pool[0].seconds_per_token = 0.001  # 1,072 tokens take about 1 s there
    pool[0].starts[0].started -= 0.9  # the first read 900 tokens in: 48 + ⅔ × (1,244 + 64) < 1,072
    assert policy.choose(key(doc + question), pool).worker is pool[0]
    assert policy.choose(key(doc + question, BOB), pool).matched_tokens == 0  # another tenant: nothing held


def test_shared_queue_model_prices_only_what_runs_beside():
    """The earlier estimate, kept for comparison (`queue_model="shared"`): Σ min(p, u)."""
    worker = workers(1)[0]
    worker.in_flight, worker.starts = 2, pending([1072, 48])
    assert EtaCost(queue_model="shared", request_overhead=0).queued(worker, 48) == 96
    assert EtaCost(request_overhead=0).queued(worker, 48) == 1120
    with pytest.raises(ValueError, match="queue_model"):
        EtaCost(queue_model="guess")


def test_worker_learns_its_prefill_speed_from_long_prefills_only():
    worker = workers(1)[0]
    worker.observe_prefill(48, 0.5)  # a short one: mostly overhead
    assert worker.seconds_per_token is None and worker.head_progress(10.0) == 0.0
    worker.observe_prefill(1000, 1.0)
    worker.observe_prefill(1000, 2.0)
    assert worker.seconds_per_token == pytest.approx(0.7 * 0.001 + 0.3 * 0.002)
    worker.starts = [PrefillStart(500, started=10.0), PrefillStart(800, started=9.0)]
    assert worker.head_progress(9.0 + 0.0013 * 100) == pytest.approx(100)  # the oldest: 800 tokens
    assert worker.head_progress(100.0) == 800  # never more than it had


def test_share_guard_sends_past_the_share_to_a_less_busy_worker():
    """ShareGuard: over its window, a worker past max_share gives the next request to the least served
    worker with fewer requests in flight; none such, or a short history, or within the share: kept."""
    pool = workers(2)
    guard = ShareGuard(0.6, window=10, min_seen=10)
    for index in range(9):
        guard.add(pool[0] if index < 7 else pool[1])
    pool[0].in_flight = 2
    assert guard.shed(pool[0], pool) is None  # 9 seen, min_seen 10: not yet
    pool[0].in_flight = 0
    guard.add(pool[0])  # 8 of 10 on w0
    pool[0].in_flight = pool[1].in_flight = 1
    assert guard.shed(pool[0], pool) is None  # w1 is no less busy (1 and 1 in flight)
    pool[0].in_flight = pool[1].in_flight = 0
    assert guard.shed(pool[0], pool) is pool[1]  # both idle: w1's core is as free, and it served less
    pool[0].in_flight = 2
    assert guard.shed(pool[0], pool) is pool[1]
    pool[1].in_flight, pool[1].starts = 1, pending([1072])  # w1 is still computing a copy: not onto it
    assert guard.shed(pool[0], pool) is None
    pool[1].in_flight, pool[1].starts = 0, pending([])
    assert guard.shed(pool[1], pool) is None  # w1 is within its share
    policy = CacheAwarePolicy(CacheAwareSettings(max_share=0.6, warm_copy=False))  # moved (warm copies:
    tokens = list(range(100, 400))  # tests/test_router_warm_copy.py)
    for _ in range(40):
        policy.on_routed(key(tokens), pool[0])
    decision = policy.choose(key(tokens), pool)
    assert decision.worker is pool[1] and decision.reason == "share"
    assert CacheAwarePolicy(CacheAwareSettings(max_share=1.0)).choose(key(tokens), pool).reason != "share"
    with pytest.raises(ValueError, match="max_share"):
        CacheAwareSettings(max_share=0.0)


def test_share_guard_acts_from_min_seen_over_the_requests_so_far():
    """Before its window fills, the guard judges the requests seen so far once there are `min_seen` of them:
    a paced chat's first conversations all landed on the worker holding the system prompt."""
    pool = workers(2)
    guard = ShareGuard(0.6, window=32, min_seen=4)
    pool[0].in_flight = 1
    for _ in range(3):
        guard.add(pool[0])
    assert guard.shed(pool[0], pool) is None  # 3 seen
    guard.add(pool[0])
    assert guard.shed(pool[0], pool) is pool[1]  # 4 of 4 on w0, w1 idle
    assert ShareGuard(0.6, window=3, min_seen=8).min_seen == 3  # never more than the window
    with pytest.raises(ValueError, match="share_min_seen"):
        RouterConfig(share_min_seen=0)


def test_eta_cost_is_checked_and_counts_work_ahead():
    with pytest.raises(ValueError, match="load_weight"):
        EtaCost(load_weight=-1.0)
    with pytest.raises(ValueError, match="request_overhead"):
        EtaCost(request_overhead=-1.0)
    with pytest.raises(ValueError, match="load_estimate"):
        CacheAwareSettings(load_estimate="guess")
    worker = workers(1)[0]
    worker.in_flight, worker.starts = 2, pending([60, 40])
    cost = EtaCost(load_weight=0.5, request_overhead=10.0)
    assert cost.queued(worker, 30) == 60 + 40 + 20 and cost.eta(worker, 30) == 30 + 0.5 * 120
    shared = EtaCost(load_weight=0.5, request_overhead=10.0, queue_model="shared")
    assert shared.queued(worker, 30) == 30 + 30 + 20 and shared.queued(worker, 50) == 50 + 40 + 20
    assert cost.costs(50, {worker: 80}) == {worker: 0.5 * 120}  # more held than asked: nothing uncached


def test_cache_aware_eta_leaves_a_busy_holder_for_an_idle_worker():
    """SGLang's rule (requests) keeps a hit on its busy holder while the load gap is within balance_abs;
    with eta the same hit moves once the queue outweighs the prompt. A miss goes to the worker whose
    queue finishes first, whatever its tree; among equal estimates, to the smallest tree."""
    conversation, new = list(range(100, 400)), list(range(1000, 1240))
    for estimate, expected in (("requests", 0), ("eta", 1)):
        policy, pool = CacheAwarePolicy(CacheAwareSettings(load_estimate=estimate)), workers(2)
        policy.on_routed(key(conversation), pool[0])
        pool[0].in_flight, pool[0].starts = 2, pending([300, 300])  # 2 − 0 is not > balance_abs 2
        decision = policy.choose(key(conversation + new), pool)  # eta: 240 + ⅔ × (480 + 64) > 540 + 0
        assert decision.worker is pool[expected], estimate
        assert decision.reason == ("cache_hit" if estimate == "requests" else "rebalance")
    policy, pool = CacheAwarePolicy(), workers(3)
    policy.on_routed(key([9] * 50), pool[2])  # w2's tree is the bigger
    pool[0].in_flight, pool[0].starts = 1, pending([200])  # w0 and w1: 1 request each, w0's the longer
    pool[1].in_flight, pool[1].starts = 1, pending([20])
    decision = policy.choose(key(range(500, 900)), pool)  # 400 + 0 on the idle w2 < 400 + ⅔ × 52 on w1
    assert decision.worker is pool[2] and decision.reason == "smallest_tree"
    pool[2].in_flight, pool[2].starts = 1, pending([200])  # now w0 and w2 carry the same: w1 finishes first
    decision = policy.choose(key(range(1500, 1900)), pool)
    assert decision.worker is pool[1]
    for worker in pool:
        worker.in_flight, worker.starts = 0, pending([])
    policy.on_routed(key([8] * 50), pool[0])  # all idle: w1, the one empty tree, takes the new prefix
    assert policy.choose(key(range(2500, 2900)), pool).worker is pool[1]


def test_kv_events_policy_counts_what_it_just_sent_until_the_worker_reports():
    from kvserve.router.index import WorkerEvents

    policy, pool = KvEventsPolicy(), workers(2, block_size=4)
    tokens = list(range(300, 332))
    first = policy.choose(key(tokens), pool)
    assert first.reason == "least_load"
    policy.on_routed(key(tokens), first.worker)
    burst = policy.choose(key(tokens + [1, 2]), pool)  # no event yet: the prefill is still queued
    assert burst.worker is first.worker and burst.reason == "cache_hit" and burst.matched_tokens == 32
    assert policy.choose(key(tokens, BOB), pool).matched_tokens == 0  # pending entries are namespaced too
    hashes = block_hashes(tokens, 4, ALICE, "sha256")
    events = WorkerEvents(policy.index, first.worker.url, policy.pending)
    events.apply(KVEventBatch(ts=0.0, events=[BlockRemoved(hashes[2:3])]))  # reported: the index decides
    assert policy.choose(key(tokens), pool).matched_tokens == 8


def test_pending_blocks_expire_and_are_swept():
    from kvserve.router.index import PendingBlocks

    pending = PendingBlocks(ttl=10.0)
    pending.add("w", [b"a", b"b"], now=0.0)
    assert pending.holds("w", b"a", now=9.9) and not pending.holds("w", b"a", now=10.1)
    for i in range(3000):  # far past the sweep threshold: expired entries do not pile up
        pending.add("w", [i.to_bytes(4, "little")], now=100.0 + i)
    assert len(pending) < 2100


def test_kv_events_policy_needs_exact_tokens():
    policy, pool = KvEventsPolicy(), workers(2)
    approximate = RouteKey(tokens=(1, 2, 3, 4), namespace=ALICE, exact=False)
    assert policy.choose(approximate, pool).reason == "unkeyed"


# --- keys: tokens and namespaces as the server derives them -------------------------------------------


@pytest.fixture()
def api_keys(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": {"sk-a": "alice", "sk-a2": "alice", "sk-b": "bob"}}))
    return load_api_keys(path)


def test_keyer_namespaces_follow_the_key_file(api_keys):
    keyer = RequestKeyer(None, api_keys)
    body = {"prompt": [5, 6, 7]}
    a = keyer.key("/v1/completions", body, "Bearer sk-a")
    assert a.namespace == ("alice", "") and a.tokens == (5, 6, 7) and a.exact
    assert keyer.key("/v1/completions", body, "Bearer sk-a2").namespace == ("alice", "")  # one tenant, 2 keys
    assert keyer.key("/v1/completions", body, "Bearer sk-b").namespace == ("bob", "")
    salted = keyer.key("/v1/completions", {**body, "cache_salt": "s1"}, "Bearer sk-a")
    assert salted.namespace == ("alice", "s1")
    assert not keyer.key("/v1/completions", body, "Bearer sk-nope").usable  # the worker answers 401
    assert not keyer.key("/v1/completions", body, None).usable


def test_keyer_single_tenant_and_text_fallback():
    keyer = RequestKeyer(None, None)
    assert keyer.key("/v1/completions", {"prompt": [1, 2]}, "Bearer anything").namespace == ()
    assert keyer.key("/v1/completions", {"prompt": [1, 2], "cache_salt": "x"}, None).namespace == ("x",)
    text = keyer.key("/v1/completions", {"prompt": "hi"}, None)
    assert text.tokens == (ord("h"), ord("i")) and not text.exact  # no tokenizer: characters
    chat = keyer.key("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, None)
    assert chat.usable and not chat.exact
    assert not keyer.key("/v1/chat/completions", {"messages": "nope"}, None).usable
    assert not keyer.key("/v1/completions", [1, 2], None).usable


# --- command line ----------------------------------------------------------------------------------------


def test_router_and_cluster_commands_parse():
    from kvserve.cli import build_parser, engine_config_from_args
    from kvserve.router.cli import router_config
    from kvserve.router.cluster import engine_argv
    from kvserve.router.config import RouterConfig
    from kvserve.router.serve import build_policy, build_router

    args = build_parser().parse_args(["router", "--worker", "http://a:1", "--worker", "http://b:2", "--policy",
                                      "kv_events", "--cache-threshold", "0.7", "--max-share", "0.7"])
    config = router_config(args, args.workers)
    assert config.workers == ["http://a:1", "http://b:2"] and config.policy == "kv_events"
    assert config.cache_threshold == 0.7 and config.max_share == 0.7
    assert build_policy(config).shares.max_share == 0.7
    assert config.idle_copy and build_router(config).state.router.idle is not None  # idle copies: on by default
    off = build_parser().parse_args(["router", "--worker", "http://a:1", "--no-idle-copy"])
    assert build_router(router_config(off, off.workers)).state.router.idle is None
    shared = build_parser().parse_args(["router", "--worker", "http://a:1", "--idle-copy-slots", "2"])
    assert build_router(router_config(shared, shared.workers)).state.router.idle.slots == 2
    assert config.idle_copy_slots == 0  # the router alone: workers on their own hardware
    plain = build_parser().parse_args(["router", "--worker", "http://a:1", "--policy", "round_robin"])
    assert build_router(router_config(plain, plain.workers)).state.router.idle is None  # knows no cache: none
    with pytest.raises(ValueError, match="max_share"):
        RouterConfig(max_share=1.5)
    with pytest.raises(ValueError, match="queue_model"):
        RouterConfig(queue_model="lifo")
    cluster = build_parser().parse_args(["cluster", "--replicas", "3", "--num-blocks", "128", "--block-size", "8"])
    engine = engine_config_from_args(cluster)
    assert cluster.replicas == 3
    rebuilt = engine_config_from_args(build_parser().parse_args(["serve", *engine_argv(engine)]))
    assert rebuilt == engine  # the workers get exactly the engine flags the cluster was given
    serve = build_parser().parse_args(["serve", "--kv-events-endpoint", "tcp://*:5557"])
    assert serve.kv_events_endpoint == "tcp://*:5557"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--policy", "kv_events"])  # --worker is required


def test_cluster_workers_share_the_cores_unless_told(monkeypatch):
    from kvserve.cli import build_parser, engine_config_from_args
    from kvserve.router.cli import shared_cores

    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(8)))
    engine = engine_config_from_args(build_parser().parse_args(["cluster", "--replicas", "3"]))
    assert shared_cores(engine, 3).num_threads == 2
    assert shared_cores(engine, 16).num_threads == 1
    told = engine_config_from_args(build_parser().parse_args(["cluster", "--num-threads", "4"]))
    assert shared_cores(told, 3).num_threads == 4


@pytest.mark.parametrize(("open_metrics", "anonymous"), [(False, 401), (True, 200)])
def test_router_metrics_need_an_admin_key_unless_opened(tmp_path, open_metrics, anonymous):
    from fastapi.testclient import TestClient

    from kvserve.cli import build_parser
    from kvserve.router.cli import router_config
    from kvserve.router.serve import build_router

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-a": "alice", "sk-ops": {"tenant": "ops", "admin": True}}}))
    argv = ["router", "--worker", "http://127.0.0.1:9", "--api-keys", str(keys)]
    args = build_parser().parse_args(argv + (["--open-metrics"] if open_metrics else []))
    client = TestClient(build_router(router_config(args, args.workers)))  # no lifespan: no worker polls
    assert client.get("/metrics").status_code == anonymous
    assert client.get("/metrics", headers={"Authorization": "Bearer sk-a"}).status_code == (200 if open_metrics
                                                                                           else 403)
    admin = client.get("/metrics", headers={"Authorization": "Bearer sk-ops"})
    assert admin.status_code == 200 and "kvserve_router_worker_healthy" in admin.text
    assert client.get("/health").status_code == 503  # open either way (no worker joined: 503, not 401)
