"""`OutputBox`: one request's channel from the engine thread to its consumer on the event loop.

It keeps the latest snapshot only. Snapshots are cumulative (the newest holds every token, text and logprob an
older one held), so a snapshot the consumer has not read yet is replaced, not queued: a consumer that reads
slowly, or not at all, costs one snapshot, O(output length), never one per step (O(length^2)).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque

from pagoda.server.client_stream import RequestEvent
from pagoda.server.outputs import RequestOutput


class OutputBox:
    """Thread-safe channel of one request's events (client_stream.py): its acceptance, its latest snapshot, its
    failure, in order.

    The engine thread calls `put`; one coroutine on `loop` calls `get`. At most three events wait (acceptance,
    one snapshot, a failure). `unread_for` says how long the snapshot waiting now has waited unread.
    """

    __slots__ = ("_event", "_items", "_lock", "_loop", "_unread_since", "_wake_pending")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        """A box whose consumer runs on `loop`."""
        self._loop = loop
        self._lock = threading.Lock()
        self._items: deque[RequestEvent] = deque()
        self._event = asyncio.Event()  # set and cleared on the loop only
        self._wake_pending = False  # a wake-up is scheduled on the loop and has not run yet
        self._unread_since: float | None = None  # when the waiting snapshot (or the one it replaced) arrived

    def put(self, item: RequestEvent, now: float | None = None) -> None:
        """Hand `item` to the consumer (any thread); a snapshot replaces a snapshot still unread."""
        with self._lock:
            items = self._items
            if isinstance(item, RequestOutput) and items and isinstance(items[-1], RequestOutput):
                items[-1] = item  # the unread one's clock keeps running: the consumer has not read since
            else:
                items.append(item)
                if isinstance(item, RequestOutput):
                    self._unread_since = time.monotonic() if now is None else now
            if self._wake_pending:
                return
            self._wake_pending = True
        # RuntimeError: the loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        with self._lock:
            self._wake_pending = False
        self._event.set()

    async def get(self) -> RequestEvent:
        """The next event, waiting for one (the consumer's side, on the box's loop)."""
        while True:
            with self._lock:
                if self._items:
                    item = self._items.popleft()
                    if isinstance(item, RequestOutput):
                        self._unread_since = None
                    return item
                self._event.clear()
            await self._event.wait()

    def unread_for(self, now: float) -> float:
        """Seconds the waiting snapshot has waited unread at time `now` (time.monotonic()); 0 when none waits."""
        with self._lock:
            return 0.0 if self._unread_since is None else now - self._unread_since

    def __len__(self) -> int:
        """Events waiting (at most 3)."""
        with self._lock:
            return len(self._items)
