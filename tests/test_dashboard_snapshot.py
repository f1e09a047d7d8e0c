"""The cache snapshot: tree capture and shaping for both caches, tenant views, series quantiles."""

from __future__ import annotations

import random

import pytest

from kvserve.prefix.snapshot import capture_tree, shape_tree
from kvserve.server.auth import SINGLE_TENANT, Principal
from kvserve.server.dashboard import dashboard_enabled
from kvserve.server.dashboard.series import histogram_quantile
from kvserve.server.dashboard.snapshot import RawSnapshot, Renderer, SnapshotLimits, pool_view
from test_prefix_caches import BS, KINDS, finish, make, run

SHARED = list(range(100, 100 + 4 * BS))  # four whole blocks


def tails(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 2000) for _ in range(2 * BS + 3)] for _ in range(count)]


def shaped(cache, top: int = 50, visible=lambda _: True) -> list[dict]:
    raw = capture_tree(cache, max_nodes=10_000)
    return shape_tree(raw, cache.allocator.ref_counts, BS, top, now=None, visible=visible)


@pytest.mark.parametrize("kind", KINDS)
def test_shared_prefix_is_one_node_with_one_reference_per_holder(kind):
    _, cache = make(kind, num_blocks=64)
    seqs = [run(cache, SHARED + tail) for tail in tails(3)]
    nodes = shaped(cache)
    runs = [node for node in nodes if node["kind"] == "run"]
    prefix = [node for node in runs if node["start_tokens"] == 0]
    assert len(prefix) == 1, prefix
    assert prefix[0]["tokens"] == len(SHARED) and prefix[0]["refs"] == 3
    assert prefix[0]["first_token_ids"] == SHARED[:16]
    branches = [node for node in runs if node["parent"] == prefix[0]["id"]]
    assert len(branches) == 3 and all(node["refs"] == 1 and node["tokens"] == 2 * BS for node in branches)
    assert prefix[0]["subtree_tokens"] == len(SHARED) + 3 * 2 * BS
    # the tree accounts for every registered block
    assert sum(node["blocks"] for node in runs) == cache.num_cached_blocks
    for seq in seqs:
        finish(cache, seq)
    assert all(node["refs"] == 0 for node in shaped(cache) if node["kind"] == "run")


@pytest.mark.parametrize("kind", KINDS)
def test_top_n_keeps_the_largest_and_aggregates_the_rest(kind):
    _, cache = make(kind, num_blocks=256)
    for i, tail in enumerate(tails(8, seed=1)):
        finish(cache, run(cache, SHARED + tail * (1 + i % 3)))
    nodes = shaped(cache, top=3)
    runs = [node for node in nodes if node["kind"] == "run"]
    others = [node for node in nodes if node["kind"] == "other"]
    assert len(runs) == 3
    assert runs[0]["start_tokens"] == 0  # the shared prefix, the largest subtree, comes first
    kept_ids = {node["id"] for node in nodes}
    assert all(node["parent"] is None or node["parent"] in kept_ids for node in nodes)
    assert sum(node["count"] for node in others) == 8 - 2
    namespace = next(node for node in nodes if node["kind"] == "namespace")
    assert namespace["subtree_blocks"] == cache.num_cached_blocks
    assert sum(node["blocks"] for node in runs + others) == cache.num_cached_blocks


@pytest.mark.parametrize("kind", KINDS)
def test_capture_is_bounded_and_counts_what_it_did_not_walk(kind):
    _, cache = make(kind, num_blocks=256)
    for tail in tails(6, seed=2):
        finish(cache, run(cache, SHARED + tail))
    raw = capture_tree(cache, max_nodes=2)
    assert len(raw.nodes) == 2 and raw.truncated
    assert raw.unvisited_blocks == cache.num_cached_blocks - sum(len(node.blocks) for node in raw.nodes)
    assert capture_tree(cache, max_nodes=10_000).unvisited_blocks == 0


@pytest.mark.parametrize("kind", KINDS)
def test_namespaces_are_filtered_before_anything_is_shaped(kind):
    _, cache = make(kind, num_blocks=128)
    run(cache, SHARED + tails(1)[0], ("alice", ""))
    run(cache, SHARED + tails(1, seed=5)[0], ("bob", ""))
    alice_only = shaped(cache, visible=lambda ns: ns[:1] == ("alice",))
    assert {tuple(node["namespace"]) for node in alice_only} == {("alice", "")}
    assert {node["first_token_ids"][0] for node in alice_only if node["kind"] == "run"} == {SHARED[0]}


def test_snapshot_readers_find_the_fields_they_read():
    """If a cache refactor renames a field this reader uses, this fails rather than the page."""
    for kind in KINDS:
        _, cache = make(kind)
        assert hasattr(cache, "_roots" if kind == "radix" else "_entry_of")
        assert hasattr(cache.allocator, "_is_free") and hasattr(cache.allocator, "ref_counts")


def _raw_pool(refs: list[int], free: list[bool], tree) -> RawSnapshot:
    return RawSnapshot(0.0, 0.0, BS, refs, bytes(free), tree, [], [], 0, {})


def test_block_map_and_counts_for_admin_and_tenant():
    alloc, cache = make("radix", num_blocks=32)
    shared = [run(cache, SHARED + tail, ("alice", "")) for tail in tails(2)]
    bob = run(cache, SHARED + tails(1, seed=9)[0], ("bob", ""))
    raw = _raw_pool(list(alloc.ref_counts), [alloc.is_free(b) for b in range(32)], capture_tree(cache, 100))
    everything = pool_view(raw, None, True)
    assert everything["free"] == alloc.num_free and everything["cached"] == cache.num_evictable_blocks
    assert everything["used"] == alloc.num_referenced()
    assert everything["shared"] == 4  # the four prefix blocks, held by both of alice's requests
    assert everything["map"].count("2") == 4 and len(everything["map"]) == 32
    alice = Renderer("m").render(raw, Principal("alice", False))
    assert alice["pool"]["free"] is None and alice["stats"] is None
    # alice's registered blocks (no request rows here): the shared prefix (4) + two full blocks per tail
    assert alice["pool"]["hidden"] == 32 - 8 and alice["pool"]["shared"] == 4 and alice["pool"]["used"] == 8
    assert all(alice["pool"]["map"][b] == "x" for b in bob.blocks)
    assert [alice["pool"]["map"][b] for b in shared[0].blocks[:4]] == ["2"] * 4
    assert {tuple(node["namespace"]) for node in alice["tree"]["nodes"]} == {("alice", "")}
    admin = Renderer("m").render(raw, SINGLE_TENANT)
    assert admin["pool"]["hidden"] == 0 and admin["tree"]["registered_blocks"] == cache.num_cached_blocks


def test_limits_are_checked():
    with pytest.raises(ValueError, match="top"):
        SnapshotLimits(top=0)


def test_histogram_quantile_interpolates_within_buckets():
    buckets = [(0.1, 0.0), (0.2, 10.0), (0.4, 20.0), (float("inf"), 20.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.15)
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.36)
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert histogram_quantile(0.99, [(0.1, 1.0), (float("inf"), 5.0)]) == 0.1


def test_dashboard_is_on_by_default_only_with_keys_or_on_loopback():
    assert dashboard_enabled(None, "127.0.0.1", False) and dashboard_enabled(None, "::1", False)
    assert dashboard_enabled(None, "localhost", False)
    assert not dashboard_enabled(None, "0.0.0.0", False) and not dashboard_enabled(None, "example.org", False)
    assert dashboard_enabled(None, "0.0.0.0", True)
    assert dashboard_enabled(True, "0.0.0.0", False) and not dashboard_enabled(False, "127.0.0.1", True)


def test_the_walk_budget_is_shared_between_namespaces():
    _, cache = make("radix", num_blocks=256)
    for i, tail in enumerate(tails(6, seed=3)):
        finish(cache, run(cache, tail, ("alice" if i % 2 else "bob", "")))
    raw = capture_tree(cache, max_nodes=2)
    assert {node.namespace for node in raw.nodes} == {("alice", ""), ("bob", "")}


def test_series_turns_counters_and_rows_into_interval_rates():
    from kvserve.server.dashboard.series import Series
    from kvserve.server.dashboard.snapshot import RequestRow
    from kvserve.server.metrics import ServerMetrics

    stats = {"prefix_cache_queries": 100, "prefix_cache_hits": 40, "evictions": 3, "num_running": 2,
             "num_waiting": 1, "kv_cache_usage": 0.5, "num_preemptions": 0, "free_blocks": 1, "cached_blocks": 1,
             "used_blocks": 2, "num_blocks": 4}
    metrics = ServerMetrics(lambda: stats, "m", 2048)
    series = Series(metrics)
    row = lambda rid, computed, cached=0: RequestRow(rid, (), "running", 10, cached, computed, 0, [], 0.0)
    assert series.sample(stats, 10.0, [row("a", 50, 16)]) is None  # the first call only sets the baseline
    stats.update(prefix_cache_queries=200, prefix_cache_hits=140, evictions=7)
    metrics.ttft.observe(0.3)
    metrics.totals.generation_tokens += 20
    point = series.sample(stats, 12.0, [row("a", 90, 16), row("b", 30, 16)])
    assert point.hit_ratio == 1.0 and point.evictions == 4 and point.output_tps == 10.0
    assert point.computed_tps == (40 + 14) / 2  # a grew by 40, b is new: 30 computed minus 16 cached
    assert 0.25 <= point.ttft_p50 <= 0.5 and point.running == 2
    assert series.columns()["hit_ratio"] == [1.0]


def test_prefix_cache_off_draws_an_empty_tree():
    from kvserve.kv.block_allocator import BlockAllocator
    from kvserve.prefix.base import NoPrefixCache

    raw = capture_tree(NoPrefixCache(BlockAllocator(8), BS), max_nodes=10)
    assert raw.kind == "off" and raw.nodes == [] and not raw.truncated
    assert shape_tree(raw, [0] * 8, BS, 10, now=None) == []


def test_serve_takes_the_dashboard_flag():
    from kvserve.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve"]).dashboard is None
    assert parse(["serve", "--dashboard"]).dashboard is True
    assert parse(["serve", "--no-dashboard"]).dashboard is False
