"""The front end's side of sleep mode with engine cores: each sleep or wake goes to every ready core and completes
once all of them answered; a core that (re)starts while the cores sleep is put to sleep too.

A call's future gives None, or raises the first refusal as a `SleepModeError` (naming its field). A replica that
dies before answering is not waited for: it restarts awake, and is sent the sleep again if the cores sleep.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass

from pagoda.server.core.sleep_frames import SleepDone, SleepEngine, WakeEngine
from pagoda.server.engine.sleep import WAKE_TAGS, SleepModeError


@dataclass(slots=True)
class _Call:
    """One broadcast: who still owes an answer, and the first refusal."""

    future: Future[None]
    waiting: set[int]
    error: SleepModeError | None = None


class SleepCalls:
    """Calls in flight by id, and what the cores should be doing (the level slept at and the tags asleep)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self.level: int | None = None  # the level of the last sleep while any tag is asleep
        self.asleep: set[str] = set()

    @property
    def pending(self) -> bool:
        """Whether a call still waits for a core's answer (the engine thread must keep reading frames)."""
        return bool(self._calls)

    def sleep(self, level: int, replicas: list[int]) -> tuple[SleepEngine, Future[None]]:
        """A sleep for the given (ready) replicas: its frame and its future."""
        self.level, self.asleep = level, set(WAKE_TAGS)
        frame = SleepEngine(next(self._ids), level)
        return frame, self._start(frame.call_id, replicas)

    def wake(self, tags: list[str] | None, replicas: list[int]) -> tuple[WakeEngine, Future[None]]:
        """A wake for the given (ready) replicas: its frame and its future."""
        self.asleep.difference_update(WAKE_TAGS if tags is None else tags)
        if not self.asleep:
            self.level = None
        frame = WakeEngine(next(self._ids), tags)
        return frame, self._start(frame.call_id, replicas)

    def replay(self) -> list[SleepEngine | WakeEngine]:
        """What a core that just became ready must do to match the others (answers are not waited for)."""
        if self.level is None:
            return []
        frames: list[SleepEngine | WakeEngine] = [SleepEngine(next(self._ids), self.level)]
        awake: list[str] = [tag for tag in WAKE_TAGS if tag not in self.asleep]
        if awake:
            frames.append(WakeEngine(next(self._ids), awake))
        return frames

    def _start(self, call_id: int, replicas: list[int]) -> Future[None]:
        future: Future[None] = Future()
        call = _Call(future, set(replicas))
        self._calls[call_id] = call
        self._settle(call_id, call)
        return future

    def answer(self, replica: int, done: SleepDone) -> None:
        """Record a core's answer."""
        call = self._calls.get(done.call_id)
        if call is None or replica not in call.waiting:
            return  # a replayed call's answer, or a stray one
        call.waiting.discard(replica)
        if done.message is not None and call.error is None:
            call.error = SleepModeError(f"engine core {replica}: {done.message}", done.param)
        self._settle(done.call_id, call)

    def replica_lost(self, replica: int) -> None:
        """A replica died: no call waits for it any longer."""
        for call_id, call in list(self._calls.items()):
            if replica in call.waiting:
                call.waiting.discard(replica)
                self._settle(call_id, call)

    def _settle(self, call_id: int, call: _Call) -> None:
        """Complete the call once nobody owes an answer."""
        if call.waiting:
            return
        del self._calls[call_id]
        if call.error is None:
            call.future.set_result(None)
        else:
            call.future.set_exception(call.error)
