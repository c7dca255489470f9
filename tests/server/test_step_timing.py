"""The step timer: a step's time is one turn of the engine loop (from the previous update when the loop went
straight on), reported to the scheduler after the update."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import cast

import pytest
from pagoda.scheduler import SchedulerOutput
from pagoda.scheduler.testing.slo_sim import step_seconds as machine_seconds
from pagoda.server.engine import step_timing
from pagoda.server.engine.executor.base import Executor
from pagoda.server.engine.sample_failures import SampleFailures
from pagoda.server.engine.step_sampler import SampledStep
from pagoda.server.engine.step_timing import StepTimer, measure_step_prior


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """The scheduler's side: steps reported, and whether requests remain."""

    def __init__(self) -> None:
        self.steps: list[tuple[SchedulerOutput, float]] = []
        self.unfinished = True

    def record_step(self, out: SchedulerOutput, seconds: float) -> None:
        """Keep the report."""
        self.steps.append((out, seconds))

    def has_unfinished_requests(self) -> bool:
        """As set by the test."""
        return self.unfinished


def turn(timer: StepTimer, clock: Clock, sched: Recorder, gap: float, run: float) -> SchedulerOutput:
    """`gap` s of loop work (scheduling, outputs), then a step whose execution and update take `run` s."""
    clock.now += gap
    out = cast(SchedulerOutput, object())  # the timer only passes it on
    timer.before_execute(out)
    clock.now += run
    timer.after_update(sched, SampledStep((), (), SampleFailures()), clock.now)  # type: ignore[arg-type]
    return out


def test_a_step_counts_the_loop_work_since_the_previous_update() -> None:
    """The second step's time includes the loop's 4 ms between the first's update and its execution."""
    clock, sched = Clock(), Recorder()
    timer = StepTimer(clock)
    first = turn(timer, clock, sched, 0.5, 0.010)  # the first step: nothing before it counts
    second = turn(timer, clock, sched, 0.004, 0.010)  # the loop went straight on: its 4 ms count
    assert [out for out, _ in sched.steps] == [first, second]
    assert [round(s, 6) for _, s in sched.steps] == [0.010, 0.014]


def test_a_wait_an_idle_step_or_a_long_gap_is_not_counted() -> None:
    """After a step that left nothing to do, after an idle step, and past a second's gap: the execution only."""
    clock, sched = Clock(), Recorder()
    timer = StepTimer(clock)
    sched.unfinished = False
    turn(timer, clock, sched, 0.0, 0.010)  # nothing left after it: the engine waits for requests
    sched.unfinished = True
    turn(timer, clock, sched, 0.3, 0.010)
    assert timer.wait(0.01) is False  # an idle step (nothing scheduled)
    turn(timer, clock, sched, 0.2, 0.010)
    turn(timer, clock, sched, 2.0, 0.010)  # past the longest gap the loop's own work takes
    assert [round(s, 6) for _, s in sched.steps] == [0.010, 0.010, 0.010, 0.010]


def test_the_probes_recover_a_machines_step_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe steps timed on a machine whose step costs are known exactly: the fitted prior is that machine's
    (a, b, c, d), and every probe stayed within the engine's limits."""
    truth = (0.006, 0.0011, 0.0015, 0.0008)
    seen: list[SchedulerOutput] = []

    def timed(run: partial[object], device: object, rounds: int) -> float:
        step = cast(SchedulerOutput, run.args[0])
        seen.append(step)
        return machine_seconds(step, truth)

    monkeypatch.setattr(step_timing, "_best_seconds", timed)
    executor = SimpleNamespace(
        driver=SimpleNamespace(kv_cache=SimpleNamespace(shape=SimpleNamespace(block_size=16)), device="cpu"),
        num_blocks=256,
        execute=lambda step, lens: None,
    )
    prior = measure_step_prior(cast(Executor, executor), 512, 2048, 16)
    assert prior == pytest.approx(truth, rel=1e-3)
    assert len(seen) == 8
    assert all(s.num_batched_tokens <= 512 and len(s.scheduled) <= 17 for s in seen)
    assert all(c.seq_len <= 2048 and max(c.block_table) < 256 for s in seen for c in s.scheduled)
