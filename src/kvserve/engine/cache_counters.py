"""Prefix-cache hit counters in tokens, kept by the scheduler at each admission: what `/metrics`,
`engine.stats()` and the router's hit rates read. A preempted request's re-match is counted apart, so a
preemption's recompute never looks like a cache hit."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.engine.request import Request
from kvserve.tiers.offload import SOURCES


@dataclass(slots=True)
class PrefixCacheCounters:
    """Prefix cache statistics in tokens; a preempted request's re-match is counted apart."""

    queries: int = 0
    hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=1000))  # (queried, hit) per request
    hits_by_source: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))  # splits `hits`

    def record(self, request: Request, num_matched_tokens: int) -> None:
        if request.background:
            return  # a router's idle copy is not a caller's query: hit rates stay the callers'
        if request.was_admitted:  # preempted (or a fork that found no room): a re-match
            self.preempted_queries += request.num_prompt_tokens
            self.preempted_hits += num_matched_tokens
            return
        self.queries += request.num_prompt_tokens
        self.hits += num_matched_tokens
        for source, tokens in request.cached_tokens_by_source.items():
            self.hits_by_source[source] += tokens
        self.recent.append((request.num_prompt_tokens, num_matched_tokens))

    def recent_hit_rate(self) -> float:
        queried = sum(q for q, _ in self.recent)
        return sum(h for _, h in self.recent) / queried if queried else 0.0


def split_by_source(kv_sources: dict[int, str], num_matched_tokens: int, block_size: int) -> dict[str, int]:
    """Matched tokens by the tier each block was loaded from for this admission (device: it was there)."""
    by_source = dict.fromkeys(SOURCES, 0)
    num_blocks = num_matched_tokens // block_size
    for index in range(num_blocks):
        by_source[kv_sources.get(index, "device")] += block_size
    return by_source
