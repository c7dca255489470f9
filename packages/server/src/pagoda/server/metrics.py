"""Prometheus metrics under vLLM's names with a `pagoda:` prefix, in a registry owned by one app."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagoda.server.outputs import EngineStats
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Latency buckets in seconds: from one fast CPU step to a long generation.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)


class _EngineStatsCollector(Collector):
    """Reads the engine's gauges and counters at scrape time, so they never go stale or double count."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        """Yield one family per engine gauge and counter."""
        stats = self._stats()
        labels = ["model_name"]
        gauges = [
            ("num_requests_running", "Requests in the running batch.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("num_requests_swapped", "Requests swapped out to host memory.", stats.num_swapped),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", stats.kv_cache_usage),
        ]
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(f"pagoda:{name}", doc, labels=labels)
            gauge.add_metric([self._model_name], float(value))
            yield gauge
        counters = [
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queries,
            ),
            ("prefix_cache_hits", "Prompt tokens served by the prefix cache.", stats.prefix_cache_hits),
            ("num_preemptions", "Requests preempted to free KV-cache blocks.", stats.num_preemptions),
            ("prompt_tokens", "Prompt tokens computed.", stats.prompt_tokens),
            ("generation_tokens", "Tokens generated.", stats.generation_tokens),
        ]
        for name, doc, count in counters:
            counter = CounterMetricFamily(f"pagoda:{name}", doc, labels=labels)
            counter.add_metric([self._model_name], float(count))
            yield counter


class ServerMetrics:
    """The app's metrics: engine stats read on scrape, and latency histograms fed by the request streams."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(model_name, stats))
        labels = ["model_name"]
        self._ttft = Histogram(
            "pagoda:time_to_first_token_seconds",
            "Seconds from arrival to the first generated token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._itl = Histogram(
            "pagoda:inter_token_latency_seconds",
            "Seconds between two generated tokens of one request.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._e2e = Histogram(
            "pagoda:e2e_request_latency_seconds",
            "Seconds from arrival to finish.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)

    def observe_first_token(self, seconds: float) -> None:
        """Record one request's time to first token."""
        self._ttft.observe(seconds)

    def observe_inter_token(self, seconds: float, num_tokens: int = 1) -> None:
        """Record the gap before `num_tokens` new tokens (one observation per token, the gap split evenly)."""
        for _ in range(num_tokens):
            self._itl.observe(seconds / num_tokens)

    def observe_e2e(self, seconds: float) -> None:
        """Record one request's end-to-end latency."""
        self._e2e.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
