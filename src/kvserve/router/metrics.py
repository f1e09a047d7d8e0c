"""The router's Prometheus metrics: decisions by policy and reason, per-worker load and match rate,
retries, and where the proxy's time goes (routing work vs. waiting for the worker's first byte)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.router.workers import Worker

ROUTING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
FIRST_BYTE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class WorkerCollector(Collector):
    """Per-worker gauges read from the pool (and the policy's index) at scrape time."""

    def __init__(self, workers: Callable[[], list[Worker]],
                 index_sizes: Callable[[], list[tuple[str, str, int]]] | None = None) -> None:
        self._workers = workers
        self._index_sizes = index_sizes

    def collect(self) -> Iterator[Metric]:
        families = {
            "healthy": GaugeMetricFamily("kvserve_router_worker_healthy", "1 while the worker is in the pool.",
                                         labels=["worker"]),
            "in_flight": GaugeMetricFamily("kvserve_router_worker_in_flight",
                                           "Requests this router has outstanding on the worker.", labels=["worker"]),
            "pending_prefill": GaugeMetricFamily(
                "kvserve_router_worker_pending_prefill_tokens",
                "Uncached prompt tokens of this router's requests on the worker still before their first token.",
                labels=["worker"]),
            "running": GaugeMetricFamily("kvserve_router_worker_running", "Running requests (polled).",
                                         labels=["worker"]),
            "waiting": GaugeMetricFamily("kvserve_router_worker_waiting", "Waiting requests (polled).",
                                         labels=["worker"]),
            "kv_usage": GaugeMetricFamily("kvserve_router_worker_kv_usage_ratio", "KV usage (polled).",
                                          labels=["worker"]),
            "generation": GaugeMetricFamily("kvserve_router_worker_generation", "Times the worker (re)joined.",
                                            labels=["worker"]),
        }
        for worker in self._workers():
            labels = [worker.url]
            families["healthy"].add_metric(labels, float(worker.healthy))
            families["in_flight"].add_metric(labels, worker.in_flight)
            families["pending_prefill"].add_metric(labels, worker.pending_prefill)
            families["running"].add_metric(labels, worker.load.running)
            families["waiting"].add_metric(labels, worker.load.waiting)
            families["kv_usage"].add_metric(labels, worker.load.kv_usage)
            families["generation"].add_metric(labels, worker.generation)
        yield from families.values()
        if self._index_sizes is not None:
            index = GaugeMetricFamily("kvserve_router_index_blocks", "Blocks the exact index (kv_events) says "
                                      "the worker holds, by medium: GPU (its pool), CPU (host RAM), DISK.",
                                      labels=["worker", "medium"])
            for worker, medium, blocks in self._index_sizes():
                index.add_metric([worker, medium], blocks)
            yield index


class RouterMetrics:
    def __init__(self, workers: Callable[[], list[Worker]],
                 index_sizes: Callable[[], list[tuple[str, str, int]]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(WorkerCollector(workers, index_sizes))
        self.decisions = Counter("kvserve_router_decisions", "Routing decisions.", ["policy", "reason"],
                                 registry=self.registry)
        self.routed = Counter("kvserve_router_requests", "Requests sent to each worker by outcome.",
                              ["worker", "outcome"], registry=self.registry)
        self.prompt_tokens = Counter("kvserve_router_prompt_tokens", "Prompt tokens of keyed requests routed.",
                                     ["worker"], registry=self.registry)
        self.matched_tokens = Counter(
            "kvserve_router_matched_tokens", "Prompt tokens the policy expected cached on the chosen worker "
            "(matched / prompt = the worker's match rate).", ["worker"], registry=self.registry)
        self.warm_copies = Counter("kvserve_router_warm_copies", "Share-guard warm copies: duplicates sent to "
                                   "compute a prompt on a less served worker, by outcome.", ["worker", "outcome"],
                                   registry=self.registry)
        self.idle_copies = Counter("kvserve_router_idle_copies", "Idle copies: prompts a worker answered, sent "
                                   "as background requests to an idle worker lacking them, by outcome.",
                                   ["worker", "outcome"], registry=self.registry)
        self.retries = Counter("kvserve_router_retries", "Requests re-sent to another worker before streaming.",
                               registry=self.registry)
        self.failures = Counter("kvserve_router_failed", "Requests that failed after no worker could take them "
                                "or mid-stream.", ["stage"], registry=self.registry)
        self.routing = Histogram("kvserve_router_routing_seconds", "Router work per request: parse, tokenize, "
                                 "decide.", buckets=ROUTING_BUCKETS, registry=self.registry)
        self.first_byte = Histogram("kvserve_router_upstream_first_byte_seconds", "From sending to a worker to "
                                    "its first response byte.", buckets=FIRST_BYTE_BUCKETS, registry=self.registry)

        self.pd_handoffs = Counter("kvserve_router_pd_handoffs", "pd: requests prefilled on a prefill worker and "
                                   "handed to a decode worker through the store.", registry=self.registry)
        self.pd_fallbacks = Counter("kvserve_router_pd_fallbacks", "pd: requests served mixed (the decode worker "
                                    "computed the prompt) because a hand-off was impossible or failed.", ["reason"],
                                    registry=self.registry)
        self.pd_prefill_seconds = Histogram("kvserve_router_pd_prefill_seconds", "pd: the prefill request of a "
                                            "hand-off, sent to answered (flush included).",
                                            buckets=FIRST_BYTE_BUCKETS, registry=self.registry)
        self.pd_flush_seconds = Histogram("kvserve_router_pd_flush_seconds", "pd: the prefill worker's wait for its "
                                          "blocks to reach the store.", buckets=FIRST_BYTE_BUCKETS,
                                          registry=self.registry)
        self.pd_handoff_bytes = Counter("kvserve_router_pd_handoff_bytes", "pd: KV bytes of the prompt blocks "
                                        "handed off through the store.", registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
