"""The dashboard's time series: one point per second over the last minutes, from successive snapshots."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from pagoda.server.dashboard.latency import percentile, since_time
from pagoda.server.dashboard.snapshot import LATENCY_WINDOW_S, EngineSnapshot
from pagoda.server.kv_tiers.connector import KVTierStats
from pagoda.server.outputs import EngineStats

HISTORY_POINTS = 300  # five minutes at one point per second


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    """The engine over one interval (rates) or at its end (gauges); None where the interval had no sample."""

    t: float  # wall-clock seconds (the page draws time axes from it)
    output_tps: float  # tokens generated per second over the interval
    running: int
    waiting: int
    swapped: int
    kv_usage: float  # fraction of device blocks in use
    prefix_hit_rate: float | None  # cached prompt tokens over looked-up ones, in the interval
    preemptions: int  # preemptions in the interval
    ttft_p50: float | None  # seconds, over snapshot.LATENCY_WINDOW_S
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    # KV tiers (None without that tier): the fraction of the tier's bytes in use, blocks it served per second.
    host_tier_usage: float | None = None
    host_tier_hits: float | None = None
    disk_tier_usage: float | None = None
    disk_tier_hits: float | None = None
    token_budget: int = 0  # the scheduler's latest step budget (the adaptive profile's choice)
    chunk_size: int = 0  # its prefill chunk cap
    ttft_attainment: float | None = (
        None  # share of the sequences finished in the interval that met their TTFT
    )
    tpot_attainment: float | None = None  # ... their TPOT (None: none finished with that objective)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def _attainment(before: EngineStats, now: EngineStats, column: int) -> float | None:
    """Met over had, summed over priority classes, between two snapshots: column 1 TTFT, 3 TPOT."""

    def sums(stats: EngineStats) -> tuple[int, int]:
        return (
            sum(row[column] for row in stats.slo_attainment),
            sum(row[column + 1] for row in stats.slo_attainment),
        )

    (met0, had0), (met1, had1) = sums(before), sums(now)
    return (met1 - met0) / (had1 - had0) if had1 > had0 else None


class SeriesRecorder:
    """Turns snapshots into points, at most one per `period` seconds, keeping the last `maxlen`."""

    def __init__(self, period: float = 1.0, maxlen: int = HISTORY_POINTS) -> None:
        """An empty history."""
        self.period = period
        self.points: deque[SeriesPoint] = deque(maxlen=maxlen)
        self._last: EngineSnapshot | None = None

    def observe(self, snap: EngineSnapshot, wall: float) -> SeriesPoint | None:
        """A new point when `period` passed since the last one (the first snapshot only sets the start)."""
        last = self._last
        if last is None:
            self._last = snap
            return None
        dt = snap.time - last.time
        if dt < self.period:
            return None
        self._last = snap
        now, before = snap.stats, last.stats
        since = snap.time - LATENCY_WINDOW_S
        ttft, itl = since_time(snap.ttft, since), since_time(snap.itl, since)
        queries = now.prefix_cache_queries - before.prefix_cache_queries
        hits = now.prefix_cache_hits - before.prefix_cache_hits
        point = SeriesPoint(
            t=wall,
            output_tps=max(0, now.generation_tokens - before.generation_tokens) / dt,
            running=now.num_running,
            waiting=now.num_waiting,
            swapped=now.num_swapped,
            kv_usage=now.kv_cache_usage,
            prefix_hit_rate=hits / queries if queries > 0 else None,
            preemptions=max(0, now.num_preemptions - before.num_preemptions),
            ttft_p50=percentile(ttft, 50),
            ttft_p99=percentile(ttft, 99),
            itl_p50=percentile(itl, 50),
            itl_p99=percentile(itl, 99),
            host_tier_usage=tier_usage(now, "host"),
            host_tier_hits=tier_hit_rate(now, before, "host", dt),
            disk_tier_usage=tier_usage(now, "disk"),
            disk_tier_hits=tier_hit_rate(now, before, "disk", dt),
            token_budget=now.token_budget,
            chunk_size=now.chunk_size,
            ttft_attainment=_attainment(before, now, 1),
            tpot_attainment=_attainment(before, now, 3),
        )
        self.points.append(point)
        return point


def tier_of(stats: EngineStats, name: str) -> KVTierStats | None:
    """The KV tier called `name` in `stats`, or None."""
    return next((t for t in stats.kv_tiers if t.tier == name), None)


def tier_usage(stats: EngineStats, name: str) -> float | None:
    """The fraction of tier `name`'s capacity in use (None without the tier)."""
    tier = tier_of(stats, name)
    if tier is None:
        return None
    return tier.used_bytes / tier.capacity_bytes if tier.capacity_bytes else 0.0


def tier_hit_rate(now: EngineStats, before: EngineStats, name: str, dt: float) -> float | None:
    """Blocks tier `name` served per second between two snapshots (None without the tier)."""
    tier = tier_of(now, name)
    if tier is None:
        return None
    last = tier_of(before, name)
    return max(0, tier.hits - (0 if last is None else last.hits)) / dt
