"""One frame producer per app, shared by every viewer: at most `max_fps` frames a second, whatever the number
of viewers or engine steps (coalesced: a frame shows the state at its instant). Each viewer has a bounded
queue; a viewer that reads slower than frames come loses the oldest unread ones, never queues them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from pagoda.server.async_llm import AsyncLLM
from pagoda.server.dashboard.encoder import encode_replica
from pagoda.server.dashboard.series import SeriesPoint, SeriesRecorder
from pagoda.server.dashboard.snapshot import EngineSnapshot, take_snapshot
from pagoda.server.dashboard.tenants import RequestOwners, frame_seq_ids, own_view
from pagoda.server.engine_client import EngineClient

logger = logging.getLogger(__name__)

MAX_FPS = 4.0
QUEUE_FRAMES = 2  # frames one viewer may leave unread before the oldest is dropped
SNAPSHOT_TIMEOUT_S = 5.0  # a wedged engine thread must not wedge the producer


class Subscription:
    """One viewer's bounded queue of encoded frames; None ends the stream."""

    def __init__(self, size: int = QUEUE_FRAMES, caller: str | None = None) -> None:
        """An empty queue of `size` frames; `caller`: the viewer's key digest (its own requests only), None for
        the whole frame (the admin key, or a server without keys)."""
        self.queue: asyncio.Queue[str | None] = asyncio.Queue(size)
        self.caller = caller
        self.dropped = 0  # frames dropped because this viewer had not read the previous ones

    def offer(self, item: str | None) -> None:
        """Queue `item`, dropping the oldest unread frame when full."""
        if self.queue.full():
            self.queue.get_nowait()
            self.dropped += 1
        self.queue.put_nowait(item)

    async def next(self) -> str | None:
        """The next frame (None: the producer closed)."""
        return await self.queue.get()


class FrameProducer:
    """Snapshots the engine (on its thread), encodes off the loop and fans frames out to subscribers."""

    def __init__(
        self,
        llm: AsyncLLM,
        *,
        max_fps: float = MAX_FPS,
        queue_frames: int = QUEUE_FRAMES,
        owners: RequestOwners | None = None,
    ) -> None:
        """A producer for `llm`; it runs only while somebody watches. `owners`: which key made each request."""
        self.llm = llm
        self.owners = owners or RequestOwners()
        self.last_frame: dict[
            str, Any
        ] = {}  # the latest frame before encoding (each key's view is cut from it)
        self.interval = 1.0 / max_fps
        self.queue_frames = queue_frames
        self.series = SeriesRecorder()
        self.subscribers: set[Subscription] = set()
        self.frames_produced = 0
        self.snapshot_seconds = 0.0  # engine-thread time spent copying state, summed over frames
        self.encode_seconds = 0.0  # off-loop time spent encoding, summed
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def subscribe(self, caller: str | None = None) -> Subscription:
        """A new viewer (`caller`: see `Subscription`); starts the producer if it was idle."""
        sub = Subscription(self.queue_frames, caller)
        if self._closed:
            sub.offer(None)
            return sub
        self.subscribers.add(sub)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pagoda-dashboard")
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """A viewer left."""
        self.subscribers.discard(sub)

    def history(self) -> str:
        """The time series so far, as one JSON message."""
        return json.dumps({"type": "history", "points": [p.to_json() for p in self.series.points]})

    async def close(self) -> None:
        """End every stream and stop producing (shutdown)."""
        self._closed = True
        for sub in self.subscribers:
            sub.offer(None)
        self.subscribers.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        """Produce frames while anyone watches and the server is not draining."""
        try:
            while self.subscribers and not self.llm.is_draining:
                start = time.monotonic()
                try:
                    data = await self.produce()
                except Exception:  # a dead engine or a failing frame: the viewers keep their last one
                    logger.debug("dashboard frame failed", exc_info=True)
                else:
                    self.fan_out(data)
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - start)))
        finally:
            if self.llm.is_draining:
                for sub in self.subscribers:
                    sub.offer(None)

    def fan_out(self, data: str) -> None:
        """Offer each viewer the frame: all of it, or its key's own view (cut once per key)."""
        frame = self.last_frame
        self.owners.keep_only(frame_seq_ids(frame))
        views: dict[str, str] = {}
        for sub in self.subscribers:
            if sub.caller is None:
                sub.offer(data)
                continue
            if sub.caller not in views:
                view = own_view(frame, self.owners.owned_by(sub.caller))
                views[sub.caller] = json.dumps(view, separators=(",", ":"))
            sub.offer(views[sub.caller])

    async def produce(self) -> str:
        """One encoded frame: snapshot on the engine thread, encode on a worker thread."""
        metrics = self.llm.metrics

        def snap(engine: EngineClient) -> tuple[EngineSnapshot, float]:
            t0 = time.perf_counter()
            return take_snapshot(engine, metrics), time.perf_counter() - t0

        snapshot, spent = await asyncio.wait_for(self.llm.call_on_engine_thread(snap), SNAPSHOT_TIMEOUT_S)
        self.snapshot_seconds += spent
        wall = time.time()
        # The history is only touched on the loop; the percentiles' sort is a few ms at most.
        point = self.series.observe(snapshot, wall)
        t0 = time.perf_counter()
        self.last_frame = await asyncio.to_thread(self.frame, snapshot, wall, point)
        data = await asyncio.to_thread(json.dumps, self.last_frame, separators=(",", ":"))
        self.encode_seconds += time.perf_counter() - t0
        self.frames_produced += 1
        return data

    def encode(self, snapshot: EngineSnapshot, wall: float, point: SeriesPoint | None) -> str:
        """The JSON frame of `snapshot`, with the new series point when one is due."""
        return json.dumps(self.frame(snapshot, wall, point), separators=(",", ":"))

    def frame(self, snapshot: EngineSnapshot, wall: float, point: SeriesPoint | None) -> dict[str, Any]:
        """The frame of `snapshot` (JSON-ready), with the new series point when one is due."""
        stats = snapshot.stats
        frame: dict[str, Any] = {
            "type": "frame",
            "t": wall,
            "model": self.llm.served_model_name,
            "replicas": [*(encode_replica(r) for r in snapshot.replicas), *snapshot.encoded],
            "stats": {
                "running": stats.num_running,
                "waiting": stats.num_waiting,
                "swapped": stats.num_swapped,
                "kv_usage": stats.kv_cache_usage,
                "num_kv_blocks": stats.num_kv_blocks,
                "preemptions": stats.num_preemptions,
                "prefix_hit_rate": stats.prefix_cache_hits / stats.prefix_cache_queries
                if stats.prefix_cache_queries
                else None,
                "generation_tokens": stats.generation_tokens,
                # host then disk: this server's hits and bytes (all replicas), the tier's occupancy
                "kv_tiers": [
                    {
                        "tier": t.tier,
                        "hits": t.hits,
                        "bytes_in": t.bytes_in,
                        "bytes_out": t.bytes_out,
                        "used_bytes": t.used_bytes,
                        "capacity_bytes": t.capacity_bytes,
                    }
                    for t in stats.kv_tiers
                ],
            },
            "point": None if point is None else point.to_json(),
        }
        return frame
