"""The cache snapshot behind `/dashboard` and `GET /v1/cache/snapshot`.

`capture(engine, limits)` runs on the engine thread between steps (through `AsyncEngine.call`) and only
copies: the pool's reference counts and free flags (two C-level list copies), a bounded walk of the
prefix tree (`kvserve.prefix.snapshot`), the running requests and the first waiting ones, and the
stats. `render(raw, viewer, ...)` then builds the JSON off the engine thread, once per kind of viewer:
an admin (or single-tenant mode) sees everything; a tenant sees only its own namespaces, requests and
blocks, with every other block drawn as "hidden" and no global counters (they would tell one tenant
about another's traffic, which is why `/metrics` is admin-only too).

Block map encoding (`pool.map`, one character per block id): `.` free, `c` cached (registered, no
reference), `1`-`9` in use with that many references, `+` ten or more, `x` not yours (tenant view).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvserve.engine.engine import LLMEngine
from kvserve.engine.request import Request
from kvserve.prefix.base import Namespace
from kvserve.prefix.snapshot import RawTree, capture_tree, shape_tree
from kvserve.server.auth import Principal

SNAPSHOT_VERSION = 1
MAP_CHARS = b".c123456789+x"  # index: 0 free, 1 cached, 1 + min(refs, 10) in use, 12 hidden
HIDDEN = 12
STAT_KEYS = (
    "num_blocks", "free_blocks", "cached_blocks", "used_blocks", "registered_blocks", "peak_used_blocks",
    "kv_cache_usage", "num_preemptions", "num_running", "num_waiting", "prefix_cache_queries",
    "prefix_cache_hits", "prefix_cache_hit_rate", "evictions",
)


@dataclass(slots=True, frozen=True)
class SnapshotLimits:
    """How much one snapshot may cost: nodes walked on the engine thread, nodes sent, rows sent."""

    max_nodes: int = 5_000  # ~1-3 us each on the engine thread
    top: int = 200
    first_tokens: int = 16
    max_waiting: int = 200
    block_map: bool = True

    def __post_init__(self) -> None:
        for name in ("max_nodes", "top", "first_tokens", "max_waiting"):
            if getattr(self, name) < 0 or (name in ("max_nodes", "top") and getattr(self, name) < 1):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(slots=True)
class RequestRow:
    request_id: str
    namespace: Namespace
    status: str
    prompt_tokens: int
    cached_tokens: int  # prefix-cache hit at admission (0 before admission)
    computed_tokens: int
    output_tokens: int
    block_ids: list[int]
    age_s: float


@dataclass(slots=True)
class RawSnapshot:
    """Copies taken on the engine thread; safe to read on any other."""

    time: float  # wall clock, seconds since the epoch
    cache_now: float  # the prefix cache's clock at capture (for node ages)
    block_size: int
    ref_counts: list[int]
    free: bytes  # 1 per free block
    tree: RawTree
    running: list[RequestRow]
    waiting: list[RequestRow]
    num_waiting: int
    stats: dict[str, float | int]
    capture_s: float = 0.0


def capture(engine: LLMEngine, limits: SnapshotLimits) -> RawSnapshot:
    """Copy what a snapshot needs. Engine thread only; bounded by `limits` (plus two list copies)."""
    start = time.perf_counter()
    manager = engine.block_manager
    allocator, cache = manager.allocator, manager.prefix_cache
    now = time.monotonic()
    scheduler = engine.scheduler
    stats = engine.stats()
    raw = RawSnapshot(
        time=time.time(), cache_now=getattr(cache, "_clock", time.monotonic)(),
        block_size=manager.block_size, ref_counts=list(allocator.ref_counts), free=_free_flags(allocator),
        tree=capture_tree(cache, limits.max_nodes, limits.first_tokens),
        running=[_row(request, now) for request in scheduler.running],
        waiting=[_row(request, now) for request in _first(scheduler.waiting, limits.max_waiting)],
        num_waiting=len(scheduler.waiting), stats={key: stats[key] for key in STAT_KEYS},
    )
    raw.capture_s = time.perf_counter() - start
    return raw


def _free_flags(allocator: Any) -> bytes:
    flags = getattr(allocator, "_is_free", None)  # the allocator's own list: one C-level copy
    if flags is None:
        flags = [allocator.is_free(block_id) for block_id in range(allocator.num_blocks)]
    return bytes(flags)


def _first(queue: Any, count: int) -> list[Request]:
    return [request for _, request in zip(range(count), queue, strict=False)]


def _row(request: Request, now: float) -> RequestRow:
    return RequestRow(
        request.request_id, request.namespace, request.status.value, request.num_prompt_tokens,
        max(request.num_cached_tokens, 0), request.num_computed_tokens, request.num_output_tokens,
        list(request.block_table), round(now - request.metrics.arrival_time, 3),
    )


# ---- rendering (any thread) ---------------------------------------------------------------------


@dataclass(slots=True)
class Renderer:
    """Turns a `RawSnapshot` into the JSON a viewer may see."""

    model_name: str
    limits: SnapshotLimits = field(default_factory=SnapshotLimits)
    decode: Callable[[list[int]], str] | None = None

    def render(self, raw: RawSnapshot, viewer: Principal) -> dict[str, Any]:
        start = time.perf_counter()
        visible = namespace_filter(viewer)
        nodes = shape_tree(raw.tree, raw.ref_counts, raw.block_size, self.limits.top, raw.cache_now, visible)
        if self.decode is not None:
            for node in nodes:
                if node["kind"] == "run":
                    node["text"] = self.decode(node["first_token_ids"])
        running = [row for row in raw.running if visible(row.namespace)]
        waiting = [row for row in raw.waiting if visible(row.namespace)]
        everything = viewer.is_admin
        own = None if everything else _own_blocks(raw, running + waiting, visible)
        snapshot = {
            "version": SNAPSHOT_VERSION, "time": raw.time, "model": self.model_name, "cache": raw.tree.kind,
            "block_size": raw.block_size, "viewer": {"tenant": viewer.tenant, "admin": viewer.is_admin},
            "pool": pool_view(raw, own, self.limits.block_map),
            "tree": {
                "nodes": nodes, "top": self.limits.top, "truncated": raw.tree.truncated,
                "visited_nodes": len(raw.tree.nodes) if everything else None,
                "registered_blocks": raw.tree.num_registered_blocks if everything else None,
                "unvisited_blocks": raw.tree.unvisited_blocks if everything else None,
            },
            "requests": {
                "running": [_row_json(row) for row in running], "waiting": [_row_json(row) for row in waiting],
                "num_running": len(running),
                "num_waiting": raw.num_waiting if everything else len(waiting),
            },
            "stats": dict(raw.stats) if everything else None,
        }
        snapshot["cost_ms"] = {"capture": round(raw.capture_s * 1e3, 3),
                               "render": round((time.perf_counter() - start) * 1e3, 3)}
        return snapshot


def namespace_filter(viewer: Principal) -> Callable[[Namespace], bool]:
    """Which namespaces a viewer may see: all for an admin, else those of its tenant.

    With API keys a tenant's requests run in `(tenant, cache_salt)` (see `server.auth.cache_namespace`),
    so the first field names the owner and no salt can spell another tenant's namespace.
    """
    if viewer.is_admin:
        return lambda _namespace: True
    tenant = viewer.tenant
    return lambda namespace: len(namespace) >= 1 and namespace[0] == tenant


def _own_blocks(raw: RawSnapshot, rows: list[RequestRow], visible: Callable[[Namespace], bool]) -> set[int]:
    own = {block_id for node in raw.tree.nodes if visible(node.namespace) for block_id in node.blocks}
    for row in rows:
        own.update(row.block_ids)
    return own


def pool_view(raw: RawSnapshot, own: set[int] | None, with_map: bool) -> dict[str, Any]:
    """Block counts and the block map; `own` None shows every block, else only those (tenant view)."""
    refs = np.asarray(raw.ref_counts, dtype=np.int64)
    free = np.frombuffer(raw.free, dtype=np.uint8).astype(bool)
    codes = np.where(free, 0, np.where(refs == 0, 1, 1 + np.minimum(refs, 10)))
    if own is not None:
        mine = np.zeros(len(refs), dtype=bool)
        mine[np.fromiter(own, dtype=np.int64, count=len(own))] = True
        codes = np.where(mine, codes, HIDDEN)
    counts = np.bincount(codes, minlength=HIDDEN + 1)
    view: dict[str, Any] = {
        "num_blocks": len(refs),
        "free": int(counts[0]) if own is None else None,
        "cached": int(counts[1]),
        "used": int(counts[2:HIDDEN].sum()),
        "shared": int(counts[3:HIDDEN].sum()),
        "hidden": int(counts[HIDDEN]),
        "map": None,
    }
    if with_map:
        view["map"] = np.frombuffer(MAP_CHARS, dtype=np.uint8)[codes].tobytes().decode("ascii")
    return view


def _row_json(row: RequestRow) -> dict[str, Any]:
    return {
        "id": row.request_id, "namespace": list(row.namespace), "status": row.status,
        "prompt_tokens": row.prompt_tokens, "cached_tokens": row.cached_tokens,
        "computed_tokens": row.computed_tokens, "output_tokens": row.output_tokens,
        "blocks": len(row.block_ids), "age_s": row.age_s,
    }
