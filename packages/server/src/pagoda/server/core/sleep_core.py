"""A core's side of sleep mode: `SleepEngine` and `WakeEngine` are applied in the order they came, between two
steps, each answered with `SleepDone`; a sleep waits until the core has no unfinished request (the front end
stops routing requests to it first, so this is the tail of what was in flight)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from pagoda.server.core.sleep_frames import SleepDone, SleepEngine, WakeEngine
from pagoda.server.engine import LLMEngine

logger = logging.getLogger(__name__)


class CoreSleep:
    """The core's sleep and wake calls not applied yet, oldest first."""

    def __init__(self, engine: LLMEngine, send: Callable[[SleepDone], None]) -> None:
        self.engine = engine
        self._send = send
        self._queue: deque[SleepEngine | WakeEngine] = deque()

    def handle(self, message: object) -> bool:
        """Queue a sleep-mode frame and apply what can be (False: `message` is not one)."""
        if not isinstance(message, SleepEngine | WakeEngine):
            return False
        self._queue.append(message)
        self.poll()
        return True

    def poll(self) -> None:
        """Apply the calls that can be, in order: a sleep only once the engine is idle."""
        while self._queue:
            call = self._queue[0]
            if isinstance(call, SleepEngine) and self.engine.has_unfinished_requests():
                return
            self._queue.popleft()
            try:
                if isinstance(call, SleepEngine):
                    self.engine.sleep(call.level)
                else:
                    self.engine.wake_up(call.tags)
            except Exception as exc:  # a SleepModeError names its field; a failed reload says why
                logger.exception("sleep-mode call %d failed", call.call_id)
                self._send(
                    SleepDone(call.call_id, str(exc) or type(exc).__name__, getattr(exc, "param", None))
                )
            else:
                self._send(SleepDone(call.call_id))
