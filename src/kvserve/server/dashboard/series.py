"""Time series for the dashboard: one point per live tick, as rates over the interval since the last.

Everything comes from what the server already has (the engine's stats, the Prometheus histograms of
`ServerMetrics`, the snapshot's request rows), so sampling adds no work on the engine thread:

- hit ratio: prompt tokens found in the prefix cache / prompt tokens looked up (device tier);
- TTFT p50 / p90: quantiles of the TTFTs observed in the interval (the server observes a request's TTFT
  when it finishes), interpolated within histogram buckets as Prometheus' `histogram_quantile` does;
- throughput: tokens the model computed per second for the running requests (prefill and decode, from
  the snapshot's request rows: the growth of each request's computed tokens), and output tokens of the
  requests that finished in the interval, per second;
- running / waiting requests and KV usage (gauges); evictions (blocks evicted in the interval).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields

from kvserve.server.dashboard.snapshot import RequestRow
from kvserve.server.metrics import ServerMetrics

MAX_POINTS = 300  # five minutes at 1 Hz


@dataclass(slots=True)
class SeriesPoint:
    time: float
    hit_ratio: float | None
    ttft_p50: float | None
    ttft_p90: float | None
    computed_tps: float
    output_tps: float
    running: int
    waiting: int
    evictions: int
    kv_usage: float


@dataclass(slots=True)
class _Counters:
    time: float
    queries: float
    hits: float
    evictions: float
    output_tokens: float
    ttft_buckets: list[tuple[float, float]]  # (upper bound, cumulative count)


class Series:
    """A ring of `SeriesPoint`s; `sample` adds one from the current counters."""

    def __init__(self, metrics: ServerMetrics, max_points: int = MAX_POINTS) -> None:
        self._metrics = metrics
        self._points: deque[SeriesPoint] = deque(maxlen=max_points)
        self._last: _Counters | None = None
        self._computed: dict[str, int] = {}  # request id -> tokens computed by the model, last sample

    def sample(
        self, stats: Mapping[str, float | int], now: float, running: Sequence[RequestRow] = ()
    ) -> SeriesPoint | None:
        """Add the point for the interval since the previous call (None on the first call)."""
        current = self._read(stats, now)
        computed = self._computed_since_last(running)
        last, self._last = self._last, current
        if last is None or current.time <= last.time:
            return None
        elapsed = current.time - last.time
        queries = current.queries - last.queries
        buckets = [(bound, count - before) for (bound, count), (_, before)
                   in zip(current.ttft_buckets, last.ttft_buckets, strict=True)]
        point = SeriesPoint(
            time=round(now, 3),
            hit_ratio=(current.hits - last.hits) / queries if queries > 0 else None,
            ttft_p50=histogram_quantile(0.5, buckets), ttft_p90=histogram_quantile(0.9, buckets),
            computed_tps=computed / elapsed,
            output_tps=(current.output_tokens - last.output_tokens) / elapsed,
            running=int(stats["num_running"]), waiting=int(stats["num_waiting"]),
            evictions=int(current.evictions - last.evictions), kv_usage=float(stats["kv_cache_usage"]),
        )
        self._points.append(point)
        return point

    def _computed_since_last(self, running: Sequence[RequestRow]) -> int:
        """Growth of each running request's model-computed tokens (a request new since the last sample
        counts from its cached prefix); a request that finished in between loses its last interval."""
        now = {row.request_id: row.computed_tokens - row.cached_tokens for row in running}
        grown = sum(max(0, done - self._computed.get(request_id, 0)) for request_id, done in now.items())
        self._computed = now
        return grown

    def columns(self) -> dict[str, list]:
        """The points as one list per field (what the page plots)."""
        points = [asdict(point) for point in self._points]
        return {f.name: [point[f.name] for point in points] for f in fields(SeriesPoint)}

    def _read(self, stats: Mapping[str, float | int], now: float) -> _Counters:
        return _Counters(
            time=now, queries=float(stats["prefix_cache_queries"]), hits=float(stats["prefix_cache_hits"]),
            evictions=float(stats["evictions"]), output_tokens=float(self._metrics.totals.generation_tokens),
            ttft_buckets=self._ttft_buckets(),
        )

    def _ttft_buckets(self) -> list[tuple[float, float]]:
        buckets = []
        for metric in self._metrics.ttft.collect():
            for sample in metric.samples:
                if sample.name.endswith("_bucket"):
                    buckets.append((float(sample.labels["le"]), sample.value))
        return buckets


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative `(upper bound, count)` buckets (ascending, last +Inf); None if empty.

    Linear within the bucket holding the rank; a rank in the +Inf bucket answers the largest finite bound.
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower
