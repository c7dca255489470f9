"""The engine extension that times each step for the scheduler's policy (the adaptive profile's cost model and
the SLO tracker): started before execution, reported after the update with the step's chunks.

A step's time is one turn of the engine loop: its execution and update plus the time since the previous step's
update when the engine went straight on (scheduling, handing the previous step's outputs to the server, whose
streams a client sees between its tokens). Measured on a 2-core CPU at 8 chats/s: timing the execution alone, the
adaptive policy's cost model missed that per-stream work, admitted ~100 streams and most missed their TPOT.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pagoda.scheduler import Scheduler, SchedulerOutput
from pagoda.server.engine.extension import Extension
from pagoda.server.engine.step_sampler import SampledStep

# A gap between steps longer than this is not the loop's own work (the engine waited, slept or was paused).
_MAX_GAP_S = 1.0


class StepTimer(Extension):
    """Measures a step from the previous step's update (when the engine went straight on) to after its own
    update, then `Scheduler.record_step`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._started: float | None = None
        self._scheduled: SchedulerOutput | None = None
        # When the last step's update ended, if requests were still unfinished then (the loop went on at once).
        self._busy_since: float | None = None

    def wait(self, timeout: float) -> bool:
        """An idle step (nothing scheduled): the next step's time starts at its own execution."""
        self._busy_since = None
        return False

    def before_execute(self, scheduled: SchedulerOutput) -> None:
        """The model is about to run this step: its clock starts (at the last update, if the loop went on)."""
        now = self._clock()
        busy = self._busy_since
        self._started = busy if busy is not None and now - busy <= _MAX_GAP_S else now
        self._scheduled = scheduled

    def after_update(self, scheduler: Scheduler, sampled: SampledStep, now: float) -> None:
        """Report the step's time (the loop's turn, execution, sampling, the update) and its shape."""
        if self._started is None or self._scheduled is None:
            return
        end = self._clock()
        scheduler.record_step(self._scheduled, end - self._started)
        self._started = self._scheduled = None
        self._busy_since = end if scheduler.has_unfinished_requests() else None
