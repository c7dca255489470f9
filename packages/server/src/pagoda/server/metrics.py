"""Prometheus metrics under vLLM's names and meanings, with a `pagoda:` prefix (`--metrics-prefix vllm` gives vLLM's
own names, so stock vLLM Grafana dashboards work unchanged), in a registry owned by one app."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagoda.server.dashboard.latency import LatencyWindow
from pagoda.server.engine_client import ReplicaSet, ReplicaStatus
from pagoda.server.kv_tiers.connector import KVTierStats
from pagoda.server.outputs import EngineStats, FinishReason, RequestOutput
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Latency buckets in seconds: from one fast CPU step to a long generation.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
# vLLM's buckets for the phase histograms (queue, prefill, decode, inference) and tokens per engine step.
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_METRICS_PREFIX = "pagoda"


class _EngineStatsCollector(Collector):
    """Reads the engine's gauges and counters at scrape time, so they never go stale or double count.

    With data-parallel replicas every series is per replica, labelled `engine` (vLLM's label), and the router's
    hit and miss counters and each replica's liveness come with them.
    """

    def __init__(
        self, model_name: str, stats: Callable[[], EngineStats], prefix: str, replicas: ReplicaSet | None
    ) -> None:
        self._model_name = model_name
        self._stats = stats
        self._prefix = prefix
        self._replicas = replicas

    def _group_usage(self, labels: list[str], engines: list[tuple[list[str], EngineStats]]) -> Metric:
        """KV usage per KV cache group (engines with sliding-window groups; none with one group)."""
        gauge = GaugeMetricFamily(
            f"{self._prefix}:kv_cache_group_usage_perc",
            "Fraction of KV-cache blocks each KV cache group holds (0 to 1).",
            labels=[*labels, "kv_cache_group"],
        )
        for values, stats in engines:
            for group, usage in enumerate(stats.kv_cache_usage_per_group):
                gauge.add_metric([*values, str(group)], usage)
        return gauge

    def collect(self) -> Iterable[Metric]:
        """Yield one family per engine gauge and counter."""
        if self._replicas is None:
            engines: list[tuple[list[str], EngineStats]] = [([self._model_name], self._stats())]
            labels = ["model_name"]
        else:
            status = self._replicas.replica_status()
            engines = [
                ([self._model_name, str(i)], r.stats) for i, r in enumerate(status) if r.stats is not None
            ]
            labels = ["model_name", "engine"]
            yield from self._replica_families(status)
        gauges: list[tuple[str, str, Callable[[EngineStats], float]]] = [
            ("num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
            ("num_requests_swapped", "Requests swapped out to host memory.", lambda s: s.num_swapped),
            (
                "kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (0 to 1).",
                lambda s: s.kv_cache_usage,
            ),
        ]
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(f"{self._prefix}:{name}", doc, labels=labels)
            for values, stats in engines:
                gauge.add_metric(values, float(value(stats)))
            yield gauge
        yield self._group_usage(labels, engines)
        counters: list[tuple[str, str, Callable[[EngineStats], float]]] = [
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                lambda s: s.prefix_cache_queries,
            ),
            ("prefix_cache_hits", "Prompt tokens served by the prefix cache.", lambda s: s.prefix_cache_hits),
            ("num_preemptions", "Requests preempted to free KV-cache blocks.", lambda s: s.num_preemptions),
            ("prompt_tokens", "Prompt tokens computed.", lambda s: s.prompt_tokens),
            ("generation_tokens", "Tokens generated.", lambda s: s.generation_tokens),
            ("spec_decode_num_drafts", "Drafted chunks verified.", lambda s: s.spec_decode_num_drafts),
            (
                "spec_decode_num_draft_tokens",
                "Draft tokens verified.",
                lambda s: s.spec_decode_num_draft_tokens,
            ),
            (
                "spec_decode_num_accepted_tokens",
                "Draft tokens accepted.",
                lambda s: s.spec_decode_num_accepted_tokens,
            ),
        ]
        for name, doc, count in counters:
            counter = CounterMetricFamily(f"{self._prefix}:{name}", doc, labels=labels)
            for values, stats in engines:
                counter.add_metric(values, float(count(stats)))
            yield counter
        per_pos = CounterMetricFamily(
            f"{self._prefix}:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the drafted run.",
            labels=[*labels, "position"],
        )
        for values, stats in engines:
            for position, accepted in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([*values, str(position)], float(accepted))
        yield per_pos
        yield from self._tiers(labels, engines)
        yield from self._slo_families(labels, engines)
        if not engines:
            return
        stats = engines[0][1]
        # vLLM's info gauge: the cache configuration (of one replica) as labels, value 1.
        info = {
            "block_size": str(stats.block_size),
            "num_gpu_blocks": str(stats.num_kv_blocks),
            "num_cpu_blocks": str(stats.num_host_blocks),
            "enable_prefix_caching": str(stats.enable_prefix_caching),
        }
        config = GaugeMetricFamily(
            f"{self._prefix}:cache_config_info",
            "Information of the KV-cache configuration.",
            labels=list(info),
        )
        config.add_metric(list(info.values()), 1.0)
        yield config

    def _tiers(self, labels: list[str], engines: list[tuple[list[str], EngineStats]]) -> Iterable[Metric]:
        """Per KV tier (label `tier`: host, disk, peer: blocks pulled from other cores over TCP): blocks served, bytes in and out, occupancy and capacity. With
        replicas the counters are each replica's own; occupancy is the tier's, which replicas on a host share."""
        tier_labels = [*labels, "tier"]
        counters: list[tuple[str, str, Callable[[KVTierStats], int]]] = [
            ("kv_tier_hits", "KV blocks a tier served (host: to the device pool).", lambda t: t.hits),
            ("kv_tier_bytes_in", "Bytes written into a KV tier.", lambda t: t.bytes_in),
            ("kv_tier_bytes_out", "Bytes read out of a KV tier.", lambda t: t.bytes_out),
        ]
        for name, doc, count in counters:
            counter = CounterMetricFamily(f"{self._prefix}:{name}", doc, labels=tier_labels)
            for values, stats in engines:
                for tier in stats.kv_tiers:
                    counter.add_metric([*values, tier.tier], float(count(tier)))
            yield counter
        gauges: list[tuple[str, str, Callable[[KVTierStats], int]]] = [
            (
                "kv_tier_used_bytes",
                "Bytes of KV blocks a tier holds (shared by the replicas on a host).",
                lambda t: t.used_bytes,
            ),
            ("kv_tier_capacity_bytes", "A KV tier's size.", lambda t: t.capacity_bytes),
        ]
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(f"{self._prefix}:{name}", doc, labels=tier_labels)
            for values, stats in engines:
                for tier in stats.kv_tiers:
                    gauge.add_metric([*values, tier.tier], float(value(tier)))
            yield gauge

    def _slo_families(
        self, labels: list[str], engines: list[tuple[list[str], EngineStats]]
    ) -> Iterable[Metric]:
        """The scheduler's step shape (gauges: the adaptive profile moves them every step) and SLO attainment
        per priority class (counters), with the steps in which adaptive gave one objective up."""
        shape: list[tuple[str, str, Callable[[EngineStats], float]]] = [
            ("scheduler_token_budget", "Token budget of the latest step.", lambda s: s.token_budget),
            ("scheduler_chunk_size", "Prefill chunk cap of the latest step.", lambda s: s.chunk_size),
            ("scheduler_max_num_seqs", "Running-batch seats of the latest step.", lambda s: s.max_num_seqs),
        ]
        for name, doc, value in shape:
            gauge = GaugeMetricFamily(f"{self._prefix}:{name}", doc, labels=labels)
            for values, stats in engines:
                gauge.add_metric(values, float(value(stats)))
            yield gauge
        met = CounterMetricFamily(
            f"{self._prefix}:slo_met",
            "Finished sequences that met their objective, by objective and priority class.",
            labels=[*labels, "slo", "priority"],
        )
        total = CounterMetricFamily(
            f"{self._prefix}:slo_requests",
            "Finished sequences that had an objective, by objective and priority class.",
            labels=[*labels, "slo", "priority"],
        )
        sacrificed = CounterMetricFamily(
            f"{self._prefix}:slo_sacrificed",
            "Steps in which the adaptive profile could not keep both objectives and gave this one up.",
            labels=[*labels, "slo"],
        )
        for values, stats in engines:
            for priority, ttft_met, ttft_total, tpot_met, tpot_total in stats.slo_attainment:
                for slo, hit, count in (("ttft", ttft_met, ttft_total), ("tpot", tpot_met, tpot_total)):
                    met.add_metric([*values, slo, str(priority)], float(hit))
                    total.add_metric([*values, slo, str(priority)], float(count))
            for slo, steps in zip(("ttft", "tpot"), stats.slo_sacrificed, strict=True):
                sacrificed.add_metric([*values, slo], float(steps))
        yield met
        yield total
        yield sacrificed

    def _replica_families(self, status: list[ReplicaStatus]) -> Iterable[Metric]:
        """Each replica's liveness and restarts, and the router's counters."""
        assert self._replicas is not None
        labels = ["model_name", "engine"]
        alive = GaugeMetricFamily(
            f"{self._prefix}:engine_alive", "1 while the replica serves.", labels=labels
        )
        restarts = CounterMetricFamily(
            f"{self._prefix}:engine_restarts", "Times the replica was restarted.", labels=labels
        )
        for i, replica in enumerate(status):
            alive.add_metric([self._model_name, str(i)], float(replica.alive))
            restarts.add_metric([self._model_name, str(i)], float(replica.restarts))
        yield alive
        yield restarts
        transfers = self._replicas.kv_transfer_counts()
        if transfers is not None:
            for name, doc, value in (
                ("kv_transfer_total", "Requests handed from a prefill core to a decode core.", transfers[0]),
                (
                    "kv_transfer_bytes_total",
                    "KV bytes the decode cores took over from the prefill cores (blocks x layers x 2 x KV heads "
                    "x head_dim x block size x dtype size).",
                    transfers[1],
                ),
                (
                    "kv_transfer_seconds_total",
                    "Seconds from a prefill core's first token to the decode core's next, summed over hand-offs.",
                    transfers[2],
                ),
            ):
                family = CounterMetricFamily(
                    f"{self._prefix}:{name.removesuffix('_total')}", doc, labels=["model_name"]
                )
                family.add_metric([self._model_name], float(value))
                yield family
        hits, misses = self._replicas.router_counts()
        for name, doc, count in (
            ("router_prefix_hits", "Requests routed to the replica holding their prefix.", hits),
            ("router_prefix_misses", "Requests routed by load (no replica held their prefix).", misses),
        ):
            counter = CounterMetricFamily(f"{self._prefix}:{name}", doc, labels=["model_name"])
            counter.add_metric([self._model_name], float(count))
            yield counter


class ServerMetrics:
    """The app's metrics: engine stats read on scrape, and latency histograms fed by the request streams."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats],
        prefix: str = DEFAULT_METRICS_PREFIX,
        replicas: ReplicaSet | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(model_name, stats, prefix, replicas))
        self.prefix = prefix  # for the app's own collectors (grammar cache)
        self._model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(f"{prefix}:{name}", doc, labels, buckets=buckets, registry=self.registry)
            return family.labels(model_name)

        self._queue = histogram(
            "request_queue_time_seconds", "Seconds a request waited to be scheduled.", _PHASE_BUCKETS
        )
        self._prefill = histogram(
            "request_prefill_time_seconds", "Seconds from first scheduled to the first token.", _PHASE_BUCKETS
        )
        self._decode = histogram(
            "request_decode_time_seconds", "Seconds from the first token to the last.", _PHASE_BUCKETS
        )
        self._inference = histogram(
            "request_inference_time_seconds",
            "Seconds from first scheduled to the last token.",
            _PHASE_BUCKETS,
        )
        self._tpot = histogram(
            "time_per_output_token_seconds",
            "Seconds between two generated tokens of one request.",
            _ITL_BUCKETS,
        )
        self._request_tpot = histogram(
            "request_time_per_output_token_seconds",
            "A request's decode time per generated token after the first.",
            _ITL_BUCKETS,
        )
        self._iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens computed or generated per engine step.",
            _ITERATION_TOKEN_BUCKETS,
        )
        self._success = Counter(
            f"{prefix}:request_success",
            "Requests (each of n samples) finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._ttft = Histogram(
            f"{prefix}:time_to_first_token_seconds",
            "Seconds from arrival to the first generated token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._itl = Histogram(
            f"{prefix}:inter_token_latency_seconds",
            "Seconds between two generated tokens of one request.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        # Raw recent samples for the dashboard's windowed percentiles (histograms only give buckets).
        self.ttft_window = LatencyWindow()
        self.itl_window = LatencyWindow()
        self._e2e = Histogram(
            f"{prefix}:e2e_request_latency_seconds",
            "Seconds from arrival to finish.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)

    def observe_first_token(self, seconds: float) -> None:
        """Record one request's time to first token."""
        self._ttft.observe(seconds)
        self.ttft_window.add(seconds)

    def observe_inter_token(self, seconds: float, num_tokens: int = 1) -> None:
        """Record the gap before `num_tokens` new tokens (one observation per token, the gap split evenly)."""
        for _ in range(num_tokens):
            self._itl.observe(seconds / num_tokens)
            self._tpot.observe(seconds / num_tokens)
        self.itl_window.add(seconds / num_tokens)

    def observe_iteration(self, num_tokens: int) -> None:
        """Record one engine step's tokens (prompt tokens computed plus tokens generated)."""
        self._iteration_tokens.observe(num_tokens)

    def observe_finished(self, reason: FinishReason) -> None:
        """Count one finished sample by its finish reason."""
        self._success.labels(self._model_name, reason).inc()

    def observe_request(self, output: RequestOutput) -> None:
        """Record a finished request's finish reasons and phase times (vLLM's definitions)."""
        for sample in output.outputs:
            if sample.finish_reason is not None:
                self.observe_finished(sample.finish_reason)
        m = output.metrics
        if m.first_scheduled_time is None:
            return
        self._queue.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is None or m.last_token_time is None:
            return
        self._prefill.observe(m.first_token_time - m.first_scheduled_time)
        self._decode.observe(m.last_token_time - m.first_token_time)
        self._inference.observe(m.last_token_time - m.first_scheduled_time)
        num_tokens = max(len(sample.token_ids) for sample in output.outputs)
        if num_tokens > 1:
            self._request_tpot.observe((m.last_token_time - m.first_token_time) / (num_tokens - 1))

    def observe_e2e(self, seconds: float) -> None:
        """Record one request's end-to-end latency."""
        self._e2e.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
