"""The engine's counters in one flat dict: what `LLM.stats()`, the server's gauges and the dashboard read."""

from __future__ import annotations

from kvserve.engine.background import num_foreground
from kvserve.engine.block_manager import BlockManager
from kvserve.engine.kv_tiers import EngineTiers
from kvserve.engine.scheduler import Scheduler


def engine_stats(manager: BlockManager, scheduler: Scheduler, tiers: EngineTiers | None) -> dict[str, float | int]:
    """Pool, scheduler, prefix-cache and tier counters (see README for each field)."""
    cache = manager.prefix_cache
    counters = scheduler.counters
    num_blocks = manager.num_blocks
    used = manager.num_used_blocks()
    running, waiting = num_foreground(scheduler.running), num_foreground(scheduler.waiting)
    return {
        "num_blocks": num_blocks,
        "block_size": manager.block_size,
        "free_blocks": manager.allocator.num_free,
        "cached_blocks": cache.num_evictable_blocks,
        "used_blocks": used,
        "registered_blocks": cache.num_cached_blocks,
        "peak_used_blocks": manager.peak_used_blocks,
        "kv_cache_usage": used / num_blocks,
        "num_preemptions": scheduler.num_preemptions,
        "num_running": running,  # a router's idle copies apart (`num_background`, engine/background.py)
        "num_waiting": waiting,
        "num_background": len(scheduler.running) + len(scheduler.waiting) - running - waiting,
        "prefix_cache_queries": counters.queries,
        "prefix_cache_hits": counters.hits,
        "prefix_cache_hit_rate": counters.recent_hit_rate(),
        "prefix_cache_preempted_queries": counters.preempted_queries,
        "prefix_cache_preempted_hits": counters.preempted_hits,
        "evictions": cache.num_evictions,
        **{f"prefix_cache_hits_{source}": tokens for source, tokens in counters.hits_by_source.items()},
        "num_loading": len(tiers.loading) if tiers is not None else 0,
        "tiers": tiers.stats() if tiers is not None else {},
        **(scheduler.speculator.counters.stats() if scheduler.speculator is not None else {}),
    }
