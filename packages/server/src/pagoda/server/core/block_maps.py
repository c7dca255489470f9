"""An engine core's dashboard view: snapshot between two steps (cheap copies), encode on a worker thread of the
core process, and hand the result back to the step loop, which alone owns the output socket."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagoda.server.dashboard.encoder import encode_replica
from pagoda.server.dashboard.snapshot import ReplicaSnapshot, replica_snapshot
from pagoda.server.engine import LLMEngine

logger = logging.getLogger(__name__)


class CoreBlockMaps:
    """At most one snapshot on its way at a time: requests while one is encoded are coalesced into it."""

    __slots__ = ("_executor", "_pending")

    def __init__(self) -> None:
        """Nothing requested yet; the worker thread starts with the first request."""
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[dict[str, Any]] | None = None

    @property
    def pending(self) -> bool:
        """Whether a snapshot is being encoded (the step loop then looks for it sooner)."""
        return self._pending is not None

    def request(self, engine: LLMEngine) -> None:
        """Snapshot `engine` now (call between two steps, on the loop's thread) and encode it off that thread."""
        if self._pending is not None:
            return
        snap = replica_snapshot(engine)
        if snap is None:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagoda-core-dashboard")
        self._pending = self._executor.submit(_encode, snap)

    def take(self) -> dict[str, Any] | None:
        """The encoded view once it is ready (then the next request snapshots again), else None."""
        pending = self._pending
        if pending is None or not pending.done():
            return None
        self._pending = None
        if (error := pending.exception()) is not None:  # a failing view must not stop the core: skip it
            logger.debug("dashboard view failed", exc_info=error)
            return None
        return pending.result()

    def close(self) -> None:
        """Stop the worker thread (a frame still being encoded is dropped)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _encode(snap: ReplicaSnapshot) -> dict[str, Any]:
    """The frame's replica object (the client sets its index: a core does not know its place in the set)."""
    return encode_replica(snap)
