"""Prometheus metrics (`GET /metrics`) with vLLM's families under `kvserve_` names.

Names, meanings and histogram buckets follow vLLM's `PrometheusStatLogger` (`vllm:x` is `kvserve_x`),
so a vLLM dashboard works after renaming the prefix; every series carries a `model_name` label (the
first served name). docs/reference.md lists each family.

Engine gauges and the prefix-cache / preemption counters are read from the engine's stats snapshot at
scrape time. Token counters and latency histograms are observed by the server as it reads each
engine output: tokens are counted as they are produced (so an aborted request's tokens count), the
latency histograms when a request finishes. There are deliberately no per-tenant labels, and with API
keys the endpoint is admin-only: counters of one tenant would otherwise tell another about its traffic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.engine.request import RequestMetrics, RequestOutput
from kvserve.tiers.offload import SOURCES

CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort")
# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so dashboards and SLO rules carry over.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
PREFILL_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)

Stats = Mapping[str, float | int]


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class EngineStatsCollector(Collector):
    """Exports the engine's `stats()` snapshot: scheduler gauges, KV usage, prefix-cache counters."""

    def __init__(self, stats: Callable[[], Stats], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        gauges = (
            ("num_requests_running", "Number of requests in model execution batches.", "num_running"),
            ("num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
            ("kv_cache_num_blocks", "KV blocks in the pool (kvserve).", "num_blocks"),
        )
        counters = (
            ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             "prefix_cache_queries"),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
            ("num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
            ("prefix_cache_evictions", "Cached blocks evicted (kvserve).", "evictions"),
        )
        for name, documentation, key in gauges:
            yield self._family(GaugeMetricFamily, name, documentation, stats[key])
        if "spec_drafts" in stats:  # vLLM's spec_decode counters, under speculative_config
            counters += (
                ("spec_decode_num_drafts", "Steps that carried draft tokens.", "spec_drafts"),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed.", "spec_draft_tokens"),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_accepted_tokens"),
            )
        for name, documentation, key in counters:
            yield self._family(CounterMetricFamily, name, documentation, stats[key])  # exposed as NAME_total
        blocks = GaugeMetricFamily("kvserve_kv_cache_blocks", "KV blocks by state (kvserve).",
                                   labels=["model_name", "state"])
        for state, key in (("free", "free_blocks"), ("cached", "cached_blocks"), ("used", "used_blocks")):
            blocks.add_metric([self._model, state], stats[key])
        yield blocks
        yield from self._tier_metrics(stats)

    def _tier_metrics(self, stats: Stats) -> Iterator[Metric]:
        """Cached prompt tokens by source, and each lower KV tier's own families (see kvserve.tiers)."""
        cached = CounterMetricFamily("kvserve_prompt_tokens_cached", "Prompt tokens served from a KV cache, by "
                                     "where the blocks were at admission (kvserve).", labels=["model_name", "source"])
        for source in SOURCES:
            cached.add_metric([self._model, source], stats.get(f"prefix_cache_hits_{source}", 0))
        yield cached
        tiers = {name: tier for name, tier in stats.get("tiers", {}).items() if name != "policy"}
        if not tiers:
            return
        labels = ["model_name", "tier"]
        families = {
            "blocks": GaugeMetricFamily("kvserve_kv_tier_blocks", "Blocks held by a KV tier.", labels=labels),
            "bytes": GaugeMetricFamily("kvserve_kv_tier_bytes", "Bytes held by a KV tier.", labels=labels),
            "hits": CounterMetricFamily("kvserve_kv_tier_hits", "Blocks read from a KV tier.", labels=labels),
            "errors": CounterMetricFamily("kvserve_kv_tier_errors", "Failed operations or damaged blocks.",
                                          labels=labels),
            "loaded": CounterMetricFamily("kvserve_kv_tier_loaded_blocks", "Blocks loaded back into the pool.",
                                          labels=labels),
            "load_seconds": CounterMetricFamily("kvserve_kv_tier_load_seconds", "Time spent loading from a tier.",
                                                labels=labels),
            "breaker": GaugeMetricFamily("kvserve_kv_tier_breaker_state", "Circuit breaker: 0 closed, 1 half "
                                         "open, 2 open (calls skipped).", labels=labels),
        }
        for name, tier in tiers.items():
            for key in ("blocks", "bytes", "hits", "errors"):
                families[key].add_metric([self._model, name], tier[key])
            families["loaded"].add_metric([self._model, name], tier["load"]["blocks"])
            families["load_seconds"].add_metric([self._model, name], tier["load"]["seconds_sum"])
            if "breaker_state_code" in tier["extra"]:
                families["breaker"].add_metric([self._model, name], tier["extra"]["breaker_state_code"])
        yield from families.values()

    def _family(self, kind: type, name: str, documentation: str, value: float) -> Metric:
        family = kind(f"kvserve_{name}", documentation, labels=["model_name"])
        family.add_metric([self._model], value)
        return family


@dataclass(slots=True)
class _Progress:
    """What the server has seen of one engine request: tokens counted per completion, last token time."""

    seen_tokens: dict[int, int] = field(default_factory=dict)  # completion index -> tokens counted
    last_token_time: float | None = None
    prompt_counted: bool = False  # counted once its prefill produced a token


@dataclass(slots=True)
class TokenTotals:
    """Plain running totals, read by the periodic stats log line."""

    prompt_tokens: int = 0
    generation_tokens: int = 0


class ServerMetrics:
    """The server's registry: engine stats, token counters and vLLM's request histograms."""

    def __init__(self, stats: Callable[[], Stats], model_name: str, max_model_len: int) -> None:
        disable_created_metrics()  # no `_created` timestamp series beside each counter (as vLLM; process-wide)
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(stats, model_name))
        self.totals = TokenTotals()
        self._progress: dict[str, _Progress] = {}
        lengths = build_1_2_5_buckets(max_model_len)
        self._prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = self._counter("generation_tokens", "Number of generation tokens processed.")
        success = Counter("kvserve_request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=self.registry)
        self._success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        histogram = self._histogram
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (as inter_token_latency).",
                              TOKEN_LATENCY_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.",
                                      TOKEN_LATENCY_BUCKETS)
        self.prefill_per_token = histogram("time_per_prefill_token_request_seconds",
                                           "Time spent per token during prefill phase in seconds.",
                                           PREFILL_TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                               REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Number of prefill tokens processed.", lengths)
        self.generation_len = histogram("request_generation_tokens", "Number of generation tokens processed.",
                                        lengths)
        self.max_generation_len = histogram("request_max_num_generation_tokens",
                                            "Histogram of maximum number of requested generation tokens.", lengths)
        self.n = histogram("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)

    def _counter(self, name: str, documentation: str) -> Counter:
        return Counter(f"kvserve_{name}", documentation, ["model_name"], registry=self.registry).labels(
            self.model_name)

    def _histogram(self, name: str, documentation: str, buckets: Iterable[float]) -> Histogram:
        family = Histogram(f"kvserve_{name}", documentation, ["model_name"], buckets=tuple(buckets),
                           registry=self.registry)
        return family.labels(self.model_name)  # the child exists from the start: zero-valued series

    # ---- observations ------------------------------------------------------------------------------
    def observe_output(self, output: RequestOutput, now: float | None = None) -> None:
        """Count what one engine output adds (call it for every output the server reads); on the final
        output of a request also observe its latency and length histograms."""
        now = time.monotonic() if now is None else now
        progress = self._progress.get(output.request_id)
        if progress is None:
            progress = self._progress[output.request_id] = _Progress()
        if not progress.prompt_counted and output.metrics.first_token_time is not None:
            progress.prompt_counted = True
            self._count_prompt(len(output.prompt_token_ids))
        new_tokens = self._count_new_tokens(progress, output)
        if new_tokens:
            if progress.last_token_time is not None:
                self._observe_gaps(now - progress.last_token_time, new_tokens)
            progress.last_token_time = now
        if output.finished:
            del self._progress[output.request_id]
            self._observe_finished(output)

    def observe_aborted(self, count: int, request_ids: Iterable[str] = ()) -> None:
        """Requests the server abandoned (client gone, shutdown): their final output is never read.
        Their tokens so far were counted already; forget their progress."""
        for request_id in request_ids:
            self._progress.pop(request_id, None)
        if count:
            self._success["abort"].inc(count)

    @property
    def num_tracked(self) -> int:
        """Requests with output seen but not finished or aborted (0 when the server is idle)."""
        return len(self._progress)

    def _count_prompt(self, num_tokens: int) -> None:
        self._prompt_tokens.inc(num_tokens)
        self.totals.prompt_tokens += num_tokens

    def _count_new_tokens(self, progress: _Progress, output: RequestOutput) -> list[int]:
        """New tokens of each completion that grew; counting lengths, not deltas, counts a beam-search
        or best_of result (reported once, at the end) as well as a streamed one."""
        new = []
        for completion in output.completions:
            length = len(completion.token_ids)
            seen = progress.seen_tokens.get(completion.index, 0)
            if length > seen:
                new.append(length - seen)
                progress.seen_tokens[completion.index] = length
        if new:
            self._generation_tokens.inc(sum(new))
            self.totals.generation_tokens += sum(new)
        return new

    def _observe_gaps(self, gap: float, new_tokens: list[int]) -> None:
        """Each completion that grew saw `gap` spread over its new tokens (n samples decode side by side,
        one token each per step: each observes the whole gap, as vLLM's per-sample requests do)."""
        for count in new_tokens:
            for _ in range(count):
                self.itl.observe(gap / count)
                self.tpot.observe(gap / count)

    def _observe_finished(self, output: RequestOutput) -> None:
        reason = output.finish_reason or "abort"
        self._success.get(reason, self._success["abort"]).inc()
        lengths = [len(c.token_ids) for c in output.completions]
        num_generated = max(lengths, default=0)
        self.prompt_len.observe(len(output.prompt_token_ids))
        self.generation_len.observe(sum(lengths))
        self.max_generation_len.observe(num_generated)
        self.n.observe(max(1, len(lengths)))
        self._observe_phases(output.metrics, len(output.prompt_token_ids), num_generated)

    def _observe_phases(self, metrics: RequestMetrics, num_prompt: int, num_generated: int) -> None:
        """vLLM's phases: queued (arrival → scheduled), prefill (→ first token), decode (→ finished)."""
        arrival, scheduled = metrics.arrival_time, metrics.first_scheduled_time
        first, finished = metrics.first_token_time, metrics.finished_time
        if finished is not None:
            self.e2e.observe(finished - arrival)
        if scheduled is not None:
            self.queue.observe(scheduled - arrival)
            if finished is not None:
                self.inference.observe(finished - scheduled)
            if first is not None:
                self.prefill.observe(first - scheduled)
                self.prefill_per_token.observe((first - scheduled) / max(1, num_prompt))
        if first is not None:
            self.ttft.observe(first - arrival)
            if finished is not None:
                self.decode.observe(finished - first)
                if num_generated > 1:
                    self.request_tpot.observe((finished - first) / (num_generated - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
