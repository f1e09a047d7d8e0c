"""Prometheus metrics (`GET /metrics`), on a registry of their own so tests can build many servers.

Engine gauges and counters are read from the engine's stats snapshot at scrape time; latency
histograms are observed by the server as requests finish. There are deliberately no per-tenant
labels, and with API keys the endpoint is admin-only: hit counters and latencies of one tenant would
otherwise tell another about its traffic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.engine.request import RequestOutput

TTFT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0
)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
CONTENT_TYPE = CONTENT_TYPE_LATEST

Stats = Mapping[str, float | int]


class EngineStatsCollector(Collector):
    """Exports the engine's `stats()` snapshot under the names ARCHITECTURE.md promises."""

    def __init__(self, stats: Callable[[], Stats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield _counter("kvserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                       stats["prefix_cache_queries"])
        yield _counter("kvserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                       stats["prefix_cache_hits"])
        yield _counter("kvserve_num_preemptions", "Requests preempted for lack of KV blocks.",
                       stats["num_preemptions"])
        yield _counter("kvserve_prefix_cache_evictions", "Cached blocks evicted.", stats["evictions"])
        yield _gauge("kvserve_kv_cache_usage_ratio", "Fraction of KV blocks referenced by requests.",
                     stats["kv_cache_usage"])
        yield _gauge("kvserve_num_requests_running", "Requests being computed.", stats["num_running"])
        yield _gauge("kvserve_num_requests_waiting", "Requests queued for admission.", stats["num_waiting"])
        blocks = GaugeMetricFamily("kvserve_kv_cache_blocks", "KV blocks by state.", labels=["state"])
        for state, key in (("free", "free_blocks"), ("cached", "cached_blocks"), ("used", "used_blocks")):
            blocks.add_metric([state], stats[key])
        yield blocks
        yield _gauge("kvserve_kv_cache_num_blocks", "KV blocks in the pool.", stats["num_blocks"])


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)  # exposed as NAME_total


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


class ServerMetrics:
    """The server's registry: engine stats plus request latency histograms and token counters."""

    def __init__(self, stats: Callable[[], Stats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(stats))
        self.ttft = Histogram(
            "kvserve_time_to_first_token_seconds", "Time from arrival to the first output token.",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.tpot = Histogram(
            "kvserve_time_per_output_token_seconds", "Mean time between output tokens of a request.",
            buckets=TPOT_BUCKETS, registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "kvserve_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "kvserve_generation_tokens", "Output tokens of finished requests.", registry=self.registry
        )
        self.finished = Counter(
            "kvserve_requests_finished", "Finished engine requests by finish reason.", ["finish_reason"],
            registry=self.registry,
        )

    def observe_finished(self, output: RequestOutput) -> None:
        """Record one finished engine request: one per prompt, whatever its n (its prompt was prefilled
        once); output tokens of all its returned completions count."""
        self.finished.labels(output.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        completion_lengths = [len(c.token_ids) for c in output.completions]
        self.generation_tokens.inc(sum(completion_lengths))
        metrics = output.metrics
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        num_tokens = max(completion_lengths, default=0)  # the longest: it decoded until finished_time
        if num_tokens > 1 and metrics.first_token_time is not None and metrics.finished_time is not None:
            self.tpot.observe((metrics.finished_time - metrics.first_token_time) / (num_tokens - 1))

    def observe_aborted(self, count: int) -> None:
        """Requests the server abandoned (client gone, shutdown): their final output is never read."""
        if count:
            self.finished.labels("abort").inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
