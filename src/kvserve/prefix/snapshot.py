"""Read-only pictures of a prefix cache's tree, for the dashboard and `GET /v1/cache/snapshot`.

Two phases, so the engine never waits on presentation work:

1. `capture_tree(cache, max_nodes)` runs on the engine thread between steps. It walks the cache
   breadth first and records, per node, references to what a picture needs (parent, namespace, block
   ids, key tokens, last access). It visits at most `max_nodes` nodes: the blocks of nodes it did not
   reach are counted (`unvisited_blocks`), never walked, so its cost is bounded whatever the cache
   holds. (A hash cache is read in registration order: with more entries than the budget, its picture
   covers the oldest ones.)
2. `shape_tree(raw, ref_counts, top, visible)` runs on any thread over those copies: chains are merged
   into runs (an only child held by as many requests as its parent joins the parent's run: a hash cache
   has one entry per block, and a radix tree grows one small leaf per published decode block), subtree
   sizes are summed, and the `top` largest runs are kept (a kept node's parent is always kept); the
   remaining children of a kept node are aggregated into one `other` node.

The caches are read through their existing fields (`RadixCache._roots`, `HashCache._entry_of`) and
never modified; tests pin those names, so a refactor of a cache breaks a test, not the page.
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.prefix.base import Namespace

ROOT = -1  # parent index of a node that starts its namespace's tree
ORPHAN = -2  # hash cache: the block before it was evicted (the entry is unreachable until evicted itself)


@dataclass(slots=True)
class RawNode:
    """One captured node: a run of whole blocks (one block for a hash entry)."""

    parent: int  # index into RawTree.nodes, ROOT or ORPHAN
    namespace: Namespace
    blocks: Sequence[int]
    first_tokens: tuple[int, ...]
    last_access: float | None  # the cache's clock (time.monotonic by default); None when not kept
    hits: int | None  # a per-node hit counter, when the cache's eviction policy keeps one


# What the engine thread records per node, as a plain tuple (cheaper to build than an object):
# (parent index, namespace, block ids, key tokens, last access, hits).
_Record = tuple[int, Namespace, Sequence[int], Sequence[int], "float | None", "int | None"]


@dataclass(slots=True)
class RawTree:
    """What `capture_tree` recorded; `nodes` turns the records into `RawNode`s (off the engine thread).

    Records hold references to the cache's own block lists and key tuples instead of copies: the caches
    replace those on every change and never mutate them in place (radix.py splits into new lists), so a
    reference is a snapshot. Were that to change, a picture would at worst be a step newer.
    """

    kind: str  # "radix" | "hash" | "off"
    records: list[_Record] = field(default_factory=list)
    first_tokens: int = 16
    num_registered_blocks: int = 0
    unvisited_blocks: int = 0

    @property
    def truncated(self) -> bool:
        return self.unvisited_blocks > 0

    @property
    def nodes(self) -> list[RawNode]:
        k = self.first_tokens
        return [RawNode(parent, namespace, blocks, tuple(key[:k]), last_access, hits)
                for parent, namespace, blocks, key, last_access, hits in self.records]


def capture_tree(cache: Any, max_nodes: int, first_tokens: int = 16) -> RawTree:
    """Record at most `max_nodes` nodes of `cache` (RadixCache, HashCache or the no-op cache)."""
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    if hasattr(cache, "_roots"):
        raw = _capture_radix(cache, max_nodes)
    elif hasattr(cache, "_entry_of"):
        raw = _capture_hash(cache, max_nodes)
    elif cache.num_cached_blocks == 0:
        return RawTree("off")
    else:
        raise TypeError(f"no snapshot reader for prefix cache {type(cache).__name__}")
    raw.first_tokens = first_tokens
    raw.num_registered_blocks = cache.num_cached_blocks
    raw.unvisited_blocks = raw.num_registered_blocks - sum(len(record[2]) for record in raw.records)
    return raw


def _capture_radix(cache: Any, max_nodes: int) -> RawTree:
    """Breadth first, one node from each open sibling group in turn, so a namespace (or a node) with
    100k children cannot use up the budget alone, and nothing is touched beyond the budget."""
    # The hot loop of the engine-thread part (about a microsecond a node): references only, no
    # copies, no per-node getattr fallbacks.
    raw = RawTree("radix")
    records = raw.records
    groups = deque((ROOT, namespace, iter(root.children.values())) for namespace, root in cache._roots.items())
    counts_hits = None
    while groups and len(records) < max_nodes:
        parent, namespace, children = groups[0]
        node = next(children, None)
        if node is None:
            groups.popleft()
            continue
        groups.rotate(-1)
        if counts_hits is None:
            counts_hits = hasattr(node, "hits")
        if node.children:
            groups.append((len(records), namespace, iter(node.children.values())))
        records.append((parent, namespace, node.blocks, node.key, node.last_access,
                        node.hits if counts_hits else None))
    return raw


def _capture_hash(cache: Any, max_nodes: int) -> RawTree:
    """Entries in registration order (a block's parent is registered before it, unless re-registered)."""
    raw = RawTree("hash")
    index_of: dict[int, int] = {}
    parent_ids: list[int | None] = []
    counts_hits = None
    for entry in itertools.islice(cache._entry_of.values(), max_nodes):
        if counts_hits is None:
            counts_hits = hasattr(entry, "hits")
        index_of[id(entry)] = len(raw.records)
        parent_ids.append(None if entry.parent is None else id(entry.parent))
        raw.records.append((ROOT, entry.namespace, (entry.block_id,), entry.tokens, None,
                            entry.hits if counts_hits else None))
    for index, parent_id in enumerate(parent_ids):
        if parent_id is not None:  # ids compared among objects all alive at capture time
            raw.records[index] = (index_of.get(parent_id, ORPHAN), *raw.records[index][1:])
    return raw


# ---- shaping (any thread) -----------------------------------------------------------------------


@dataclass(slots=True)
class _Run:
    """A node after chain merging: raw nodes joined end to end, and its place in the tree."""

    parent: int  # index into the run list, or ROOT / ORPHAN
    namespace: Namespace
    blocks: list[int]
    first_tokens: tuple[int, ...]
    last_access: float | None
    hits: int | None
    refs: int  # of its first raw node (every node merged into it has the same)
    start_blocks: int = 0  # blocks before it on its path (unknown above an orphan: counted from it)
    children: list[int] = field(default_factory=list)
    subtree_blocks: int = 0


def shape_tree(
    raw: RawTree, ref_counts: Sequence[int], block_size: int, top: int, now: float | None,
    visible: Callable[[Namespace], bool] = lambda _: True,
) -> list[dict[str, Any]]:
    """The `top` largest nodes of the visible namespaces as JSON-ready dicts, parents first.

    Every namespace gets a node (kind "namespace", not counted in `top`); children of a kept node that
    did not make the cut are summed into one node of kind "other". `now` is the cache clock's current
    time (for `age_s`), None to leave ages out.
    """
    runs = _merge_chains(raw.nodes, ref_counts, visible)
    _sum_subtrees(runs)
    return _select(runs, ref_counts, block_size, top, now)


def _merge_chains(
    nodes: list[RawNode], ref_counts: Sequence[int], visible: Callable[[Namespace], bool]
) -> list[_Run]:
    """Raw nodes joined into runs: an only child with the same reference count joins its parent's run."""
    num_children = [0] * len(nodes)
    for node in nodes:
        if node.parent >= 0:
            num_children[node.parent] += 1
    runs: list[_Run] = []
    run_of: dict[int, int] = {}
    for index in _parents_first(nodes):
        node = nodes[index]
        if not visible(node.namespace):
            continue
        parent = node.parent
        refs = max(map(ref_counts.__getitem__, node.blocks))
        if parent >= 0 and num_children[parent] == 1 and runs[run_of[parent]].refs == refs:
            run = runs[run_of[parent]]
            run.blocks.extend(node.blocks)
            run_of[index] = run_of[parent]
            continue
        run_of[index] = len(runs)
        runs.append(_Run(run_of.get(parent, parent) if parent >= 0 else parent, node.namespace,
                         list(node.blocks), node.first_tokens, node.last_access, node.hits, refs))
    return runs


def _parents_first(nodes: list[RawNode]) -> list[int]:
    """Indices with every parent before its children (hash captures may list a child first)."""
    children: list[list[int]] = [[] for _ in nodes]
    tops = []
    for index, node in enumerate(nodes):
        (children[node.parent] if node.parent >= 0 else tops).append(index)
    order, queue = [], deque(tops)
    while queue:
        index = queue.popleft()
        order.append(index)
        queue.extend(children[index])
    return order


def _sum_subtrees(runs: list[_Run]) -> None:
    for index, run in enumerate(runs):
        if run.parent >= 0:
            runs[run.parent].children.append(index)
            run.start_blocks = runs[run.parent].start_blocks + len(runs[run.parent].blocks)
    for run in reversed(runs):  # children after parents, so this is post-order for the sums
        run.subtree_blocks += len(run.blocks)
        if run.parent >= 0:
            runs[run.parent].subtree_blocks += run.subtree_blocks


def _select(
    runs: list[_Run], ref_counts: Sequence[int], block_size: int, top: int, now: float | None
) -> list[dict[str, Any]]:
    namespaces: dict[Namespace, dict[str, Any]] = {}
    heap: list[tuple[int, int, int, str]] = []  # (-subtree blocks, tiebreak, run index, parent id)
    tiebreak = itertools.count()
    for index, run in enumerate(runs):
        if run.parent < 0:
            ns_node = namespaces.get(run.namespace) or _namespace_node(run.namespace, namespaces)
            ns_node["subtree_blocks"] += run.subtree_blocks
            heapq.heappush(heap, (-run.subtree_blocks, next(tiebreak), index, ns_node["id"]))
    kept: list[dict[str, Any]] = []
    while heap and len(kept) < top:
        _, _, index, parent_id = heapq.heappop(heap)
        run = runs[index]
        node = _run_node(run, parent_id, ref_counts, now)
        kept.append(node)
        for child in run.children:
            heapq.heappush(heap, (-runs[child].subtree_blocks, next(tiebreak), child, node["id"]))
    others = _aggregate_rest(heap, runs)
    nodes = [*namespaces.values(), *kept, *others]
    for node in nodes:
        node["tokens"] = node["blocks"] * block_size
        node["subtree_tokens"] = node["subtree_blocks"] * block_size
        node["start_tokens"] = node.pop("_start_blocks", 0) * block_size
    return nodes


def _namespace_node(namespace: Namespace, namespaces: dict[Namespace, dict[str, Any]]) -> dict[str, Any]:
    node = {"id": "ns:" + json.dumps(list(namespace)), "parent": None, "kind": "namespace",
            "namespace": list(namespace), "blocks": 0, "subtree_blocks": 0, "refs": 0}
    namespaces[namespace] = node
    return node


def _run_node(run: _Run, parent_id: str, ref_counts: Sequence[int], now: float | None) -> dict[str, Any]:
    refs = list(map(ref_counts.__getitem__, run.blocks))
    return {
        "id": f"b{run.blocks[0]}", "parent": parent_id, "kind": "run", "namespace": list(run.namespace),
        "blocks": len(run.blocks), "subtree_blocks": run.subtree_blocks, "_start_blocks": run.start_blocks,
        "refs": max(refs), "refs_min": min(refs), "hits": run.hits, "orphan": run.parent == ORPHAN,
        "age_s": None if now is None or run.last_access is None else round(now - run.last_access, 3),
        "first_token_ids": list(run.first_tokens), "block_ids": run.blocks[:8],
    }


def _aggregate_rest(heap: list[tuple[int, int, int, str]], runs: list[_Run]) -> list[dict[str, Any]]:
    """Nodes that did not make the cut, one `other` node per kept parent."""
    by_parent: dict[str, dict[str, Any]] = {}
    for _, _, index, parent_id in heap:
        run = runs[index]
        other = by_parent.get(parent_id)
        if other is None:
            other = by_parent[parent_id] = {
                "id": f"other:{parent_id}", "parent": parent_id, "kind": "other", "namespace": list(run.namespace),
                "blocks": 0, "subtree_blocks": 0, "_start_blocks": run.start_blocks, "refs": None, "count": 0,
            }
        other["count"] += 1
        other["blocks"] += run.subtree_blocks
        other["subtree_blocks"] += run.subtree_blocks
    return list(by_parent.values())
