"""The engine extension that times each step for the scheduler's policy (the adaptive profile's cost model and
the SLO tracker): started before execution, reported after the update with the step's chunks."""

from __future__ import annotations

import time

from pagoda.scheduler import Scheduler, SchedulerOutput
from pagoda.server.engine.extension import Extension
from pagoda.server.engine.step_sampler import SampledStep


class StepTimer(Extension):
    """Measures a step from before execution to after the scheduler's update, then `Scheduler.record_step`."""

    def __init__(self) -> None:
        self._started: float | None = None
        self._scheduled: SchedulerOutput | None = None

    def before_execute(self, scheduled: SchedulerOutput) -> None:
        """The model is about to run this step: its clock starts."""
        self._started = time.perf_counter()
        self._scheduled = scheduled

    def after_update(self, scheduler: Scheduler, sampled: SampledStep, now: float) -> None:
        """Report the step's wall time (execution, sampling, the update) and its shape."""
        if self._started is None or self._scheduled is None:
            return
        scheduler.record_step(self._scheduled, time.perf_counter() - self._started)
        self._started = self._scheduled = None
