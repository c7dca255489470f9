"""What the dashboard copies on the engine thread: per replica the block map and the queues, plus the stats and
the recent latencies. Cheap (C-level array copies, no per-block Python objects); encoding happens elsewhere."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pagoda.blockalloc import BlockManager, BlockMapSnapshot
from pagoda.scheduler import QueueView
from pagoda.server.engine_client import EngineClient
from pagoda.server.metrics import ServerMetrics
from pagoda.server.outputs import EngineStats

# The window of the TTFT / ITL percentiles (seconds).
LATENCY_WINDOW_S = 120.0


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """One engine replica at one instant."""

    replica: int
    blocks: BlockMapSnapshot | None  # None: its KV manager keeps no paged block map (--kv-manager contiguous)
    queues: QueueView
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Everything one frame is made of, taken at `time` (time.monotonic())."""

    time: float
    replicas: tuple[ReplicaSnapshot, ...]  # an in-process engine's own map (empty for engine-core processes)
    stats: EngineStats
    # (time, seconds) samples as recorded (the series keeps the last LATENCY_WINDOW_S of them, off this thread)
    ttft: tuple[tuple[float, float], ...]
    itl: tuple[tuple[float, float], ...]
    # Replicas encoded elsewhere (engine-core processes: each core encodes its own), as frame replica objects.
    encoded: tuple[dict[str, Any], ...] = ()


@runtime_checkable
class BlockMapSource(Protocol):
    """An engine client whose replicas encode their own block maps (`CoreClient`)."""

    def block_maps(self) -> tuple[dict[str, Any], ...]:
        """The replicas' latest maps as frame replica objects; asks them for the next (engine thread)."""
        ...


def replica_snapshot(engine: object, index: int = 0) -> ReplicaSnapshot | None:
    """The block map and queues of an in-process `LLMEngine` (None for any other engine client)."""
    from pagoda.server.engine import LLMEngine  # torch-heavy: imported when a frame is first made

    if not isinstance(engine, LLMEngine):
        return None
    kv = engine.kv_manager
    last = engine.last_schedule
    chunks = {} if last is None else {c.request_id: c.num_tokens for c in last.scheduled}
    return ReplicaSnapshot(
        replica=index,
        blocks=kv.snapshot() if isinstance(kv, BlockManager) else None,
        queues=engine.scheduler.queue_view(chunks),
        stats=engine.get_stats(),
    )


def take_snapshot(engine: EngineClient, metrics: ServerMetrics) -> EngineSnapshot:
    """Copy a frame's inputs; call on the engine thread (AsyncLLM.call_on_engine_thread)."""
    now = time.monotonic()
    own = replica_snapshot(engine)
    return EngineSnapshot(
        time=now,
        replicas=() if own is None else (own,),
        stats=own.stats if own is not None else engine.get_stats(),
        ttft=metrics.ttft_window.copy(),
        itl=metrics.itl_window.copy(),
        encoded=engine.block_maps() if own is None and isinstance(engine, BlockMapSource) else (),
    )
