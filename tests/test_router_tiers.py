"""The router's index and kv_events over a worker's lower tiers (router/index.py, policies/kv_events.py):
events of medium "CPU" (host RAM) and "DISK" land in per-medium sub-indexes, each medium's removals touch
only that medium, `AllBlocksCleared` clears the device's entries only (a worker's reset keeps its tiers), a
lost stream clears all; a prompt's run goes on from the device through the tiers, their tokens counted at
`tier_fetch_cost`, so a document demoted to host RAM keeps its requests on its worker instead of being
computed again elsewhere."""

from __future__ import annotations

import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvserve.events.format import MEDIUM_CPU, MEDIUM_DISK, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvserve.prefix.hashing import block_hashes
from kvserve.router.index import BlockIndex, PendingBlocks, WorkerEvents
from kvserve.router.keys import RouteKey
from kvserve.router.policies import KvEventsPolicy
from kvserve.router.policies.store import SharedStore
from kvserve.router.workers import PrefillStart, Worker, WorkerLoad

ALICE = ("alice", "")
H = [bytes([i]) * 16 for i in range(8)]


def batch(*events) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))


def test_each_medium_keeps_its_own_entries():
    index = BlockIndex()
    index.apply("w", batch(BlockStored(H[:4], None, [], 16), BlockStored(H[2:6], None, [], 16, medium=MEDIUM_CPU),
                           BlockStored(H[5:7], None, [], 16, medium=MEDIUM_DISK)))
    assert [index.holds("w", h) for h in H] == [True] * 4 + [False] * 4
    assert [index.holds_lower("w", h) for h in H] == [False, False, True, True, True, True, True, False]
    index.apply("w", batch(BlockRemoved(H[2:4], medium=MEDIUM_CPU)))  # the host dropped them: the device keeps its
    assert index.holds("w", H[2]) and not index.holds_lower("w", H[2])
    index.apply("w", batch(BlockRemoved(H[0:2])))  # device evictions leave the tiers alone
    assert not index.holds("w", H[0]) and index.holds_lower("w", H[4])
    index.apply("w", batch(AllBlocksCleared()))  # a prefix-cache reset: the device only
    assert index.num_blocks("w") == 0 and index.holds_lower("w", H[5]) and index.holds_lower("w", H[6])
    index.check_invariants()
    index.clear("w")  # a lost stream or restart: everything
    assert not any(index.holds_lower("w", h) for h in H)
    index.check_invariants()


def test_tier_events_do_not_settle_blocks_sent_to_the_device():
    """A block just routed to w is pending until its device reports it; a host event about the same hash
    (an older copy) says nothing about the computation in flight."""
    index, pending = BlockIndex(), PendingBlocks(ttl=30.0)
    now = time.monotonic()
    pending.add("w", H[:2], now)
    handler = WorkerEvents(index, "w", pending)
    handler.apply(batch(BlockStored(H[:2], None, [], 16, medium=MEDIUM_CPU)))
    assert pending.holds("w", H[0], now)
    handler.apply(batch(BlockStored(H[:1], None, [], 16)))
    assert not pending.holds("w", H[0], now) and pending.holds("w", H[1], now)


def worker(name: str, store: str | None = None) -> Worker:
    load = WorkerLoad(block_size=16, prefix_hash="sha256", remote_store=store, remote_tier="ok" if store else None)
    return Worker(url=f"http://{name}", healthy=True, load=load)


DOC = tuple(range(1024)) + tuple(range(5000, 5048))  # a 1,024-token document and a 48-token question


def demoted_document(policy: KvEventsPolicy) -> tuple[list[Worker], RouteKey]:
    """w0 read the document, then evicted it from its device into host RAM; it has one 240-token prompt
    in flight. w1 is idle and holds nothing."""
    pool = [worker("w0"), worker("w1")]
    hashes = block_hashes(list(DOC), 16, ALICE, "sha256")
    policy.index.store(pool[0].url, hashes[:64], MEDIUM_CPU)
    pool[0].in_flight, pool[0].starts = 1, [PrefillStart(240)]
    return pool, RouteKey(tokens=DOC, namespace=ALICE, exact=True)


def test_a_document_in_host_ram_keeps_its_requests_on_its_worker():
    """Tier-aware (0.1): w0 lacks 48 + 0.1 × 1,024 = 150 tokens, plus ⅔ × (240 + 32) queued, 331 against
    w1's 1,072: w0, a cache hit of 922 tokens. Device-only (1.0): cached nowhere, the least loaded (w1)."""
    aware = KvEventsPolicy(balance_abs=8)
    pool, key = demoted_document(aware)
    decision = aware.choose(key, pool)
    assert decision.worker is pool[0] and decision.reason == "cache_hit" and decision.matched_tokens == 922
    blind = KvEventsPolicy(balance_abs=8, tier_fetch_cost=1.0)
    pool, key = demoted_document(blind)
    decision = blind.choose(key, pool)
    assert decision.worker is pool[1] and decision.matched_tokens == 0
    with pytest.raises(ValueError, match="tier_fetch_cost"):
        KvEventsPolicy(tier_fetch_cost=-0.1)


def test_the_run_goes_from_the_device_into_the_tiers_and_stops_at_a_hole():
    """Device blocks 0-31, host blocks 32-47, then block 48 only on the device again (useless: the engine's
    tier lookup stops at the first block its tiers lack), and disk blocks 49-63 after it."""
    policy = KvEventsPolicy(balance_abs=8)
    pool, key = demoted_document(policy)
    hashes = block_hashes(list(DOC), 16, ALICE, "sha256")
    policy.index.clear(pool[0].url)
    policy.index.store(pool[0].url, hashes[:32] + hashes[48:49])
    policy.index.store(pool[0].url, hashes[32:48], MEDIUM_CPU)
    policy.index.store(pool[0].url, hashes[49:64], MEDIUM_DISK)
    cached = policy.cached_tokens(key, pool)
    assert cached is not None
    assert (cached.held[pool[0]], cached.reach[pool[0]], cached.published[pool[0]]) == (512, 768, 768)
    assert (cached.held[pool[1]], cached.reach[pool[1]]) == (0, 0)


def test_blocks_only_sent_are_held_but_not_published():
    """Pending device blocks, then host blocks: all reachable, but only what came before the first pending
    block was reported (a shared store has nothing else of it yet)."""
    policy = KvEventsPolicy(balance_abs=8)
    pool, key = demoted_document(policy)
    hashes = block_hashes(list(DOC), 16, ALICE, "sha256")
    policy.index.clear(pool[0].url)
    policy.index.store(pool[0].url, hashes[:8])
    policy.pending.add(pool[0].url, hashes[8:16], time.monotonic())
    policy.index.store(pool[0].url, hashes[16:24], MEDIUM_CPU)
    cached = policy.cached_tokens(key, pool)
    assert cached is not None
    assert (cached.held[pool[0]], cached.reach[pool[0]], cached.published[pool[0]]) == (256, 384, 128)


def test_a_shared_store_adds_only_beyond_what_the_worker_reaches_itself():
    """Both workers on one store. w0 reaches the whole document through its host tier; w1 can load what w0
    published from the store at 0.2. w0's own tier run is not credited again from the store."""
    policy = KvEventsPolicy(balance_abs=8)
    pool = [worker("w0", store="s"), worker("w1", store="s")]
    hashes = block_hashes(list(DOC), 16, ALICE, "sha256")
    policy.index.store(pool[0].url, hashes[:32])
    policy.index.store(pool[0].url, hashes[32:64], MEDIUM_CPU)
    key = RouteKey(tokens=DOC, namespace=ALICE, exact=True)
    cached = policy.cached_tokens(key, pool)
    assert cached is not None
    local = {w: cached.held[w] + round(0.9 * (cached.reach[w] - cached.held[w])) for w in pool}
    runs = SharedStore(0.2).effective(local, cached.published, cached.reach)
    assert runs == {pool[0]: 512 + 461, pool[1]: 819}


def test_load_reports_tier_capacity():
    load = WorkerLoad.from_json({"num_blocks": 100, "block_size": 16, "tier_blocks": 300})
    assert load.tier_blocks == 300
    assert Worker(url="http://w", load=load).capacity_tokens == 6400
    assert WorkerLoad.from_json({"num_blocks": 100, "block_size": 16}).tier_blocks == 0  # an older worker


def test_cache_aware_trees_keep_what_the_tiers_keep():
    """A tree is bounded by what its worker can keep: with 8 pool blocks (32 tokens at block size 4) and 24
    tier blocks, 128 tokens; without the tiers, 32."""
    from kvserve.router.policies import CacheAwarePolicy, CacheAwareSettings

    policy = CacheAwarePolicy(CacheAwareSettings(tree_budget=1000))
    pool = [Worker(url=f"http://w{i}", healthy=True, load=WorkerLoad(block_size=4, num_blocks=8)) for i in range(2)]
    pool[0].load.tier_blocks = 24
    for start in range(0, 400, 20):
        for target in pool:
            policy.on_routed(RouteKey(tokens=tuple(range(start, start + 20)), namespace=ALICE, exact=True), target)
    assert 32 < policy.tree(pool[0]).num_tokens <= 128
    assert policy.tree(pool[1]).num_tokens <= 32


MEDIA = ["GPU", MEDIUM_CPU, MEDIUM_DISK]


class IndexMachine(RuleBasedStateMachine):
    """The per-medium index against a model: {(worker, medium): set of hashes}. Any sequence of stored and
    removed events in any medium, device resets (`AllBlocksCleared`) and whole-worker clears leaves
    `holds` / `holds_lower` / `num_blocks` exactly as the model says, and the index's invariants hold."""

    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex()
        self.model: dict[tuple[str, str], set[bytes]] = {}

    @rule(worker=st.sampled_from(["a", "b"]), medium=st.sampled_from(MEDIA), blocks=st.lists(st.sampled_from(H)))
    def stored(self, worker: str, medium: str, blocks: list[bytes]) -> None:
        self.index.apply(worker, batch(BlockStored(blocks, None, [], 16, medium=medium)))
        self.model.setdefault((worker, medium), set()).update(blocks)

    @rule(worker=st.sampled_from(["a", "b"]), medium=st.sampled_from(MEDIA), blocks=st.lists(st.sampled_from(H)))
    def removed(self, worker: str, medium: str, blocks: list[bytes]) -> None:
        self.index.apply(worker, batch(BlockRemoved(blocks, medium=medium)))
        self.model.setdefault((worker, medium), set()).difference_update(blocks)

    @rule(worker=st.sampled_from(["a", "b"]))
    def device_reset(self, worker: str) -> None:
        self.index.apply(worker, batch(AllBlocksCleared()))
        self.model[(worker, "GPU")] = set()

    @rule(worker=st.sampled_from(["a", "b"]))
    def lost_stream(self, worker: str) -> None:
        self.index.clear(worker)
        for medium in MEDIA:
            self.model[(worker, medium)] = set()

    @invariant()
    def agrees_with_the_model(self) -> None:
        self.index.check_invariants()
        for worker in ("a", "b"):
            device = self.model.get((worker, "GPU"), set())
            lower = self.model.get((worker, MEDIUM_CPU), set()) | self.model.get((worker, MEDIUM_DISK), set())
            assert self.index.num_blocks(worker) == len(device)
            for block_hash in H:
                assert self.index.holds(worker, block_hash) == (block_hash in device)
                assert self.index.holds_lower(worker, block_hash) == (block_hash in lower)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
