"""The engine extension that times each step for the scheduler's policy (the adaptive profile's cost model and
the SLO tracker): started before execution, reported after the update with the step's chunks; and the start-up
probes that give that cost model its prior on this machine (`measure_step_prior`).

A step's time is one turn of the engine loop: its execution and update plus the time since the previous step's
update when the engine went straight on (scheduling, handing the previous step's outputs to the server), so that
the cost model predicts the gap a client sees between its tokens. (Profiled on a 2-core CPU at 8 chats/s, that
turn's own work was ~3% of the engine thread: small, but it grows with the streams.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

from pagoda.scheduler import ScheduledRequest, Scheduler, SchedulerOutput, StepSample, StepTimeModel
from pagoda.server.engine.executor.base import Executor
from pagoda.server.engine.extension import Extension
from pagoda.server.engine.preemption_costs import _best_seconds, _probe_step
from pagoda.server.engine.step_sampler import SampledStep

logger = logging.getLogger("pagoda.engine")

# A gap between steps longer than this is not the loop's own work (the engine waited, slept or was paused).
_MAX_GAP_S = 1.0
# The start-up probes of the step-time model: (decode rows, context tokens per row, prefill tokens), each bounded
# by the engine's limits. Prefill and decode rows vary apart, so that each coefficient is measured on its own.
_PROBES = (
    (1, 256, 0),
    (8, 256, 0),
    (32, 256, 0),
    (1, 1024, 0),
    (32, 1024, 0),
    (0, 0, 64),
    (0, 0, 256),
    (8, 256, 64),
)
# How firmly the online fit holds to the probes' coefficients (in typical steps, as `StepTimeModel` counts):
# under load a step's prefill barely varies, so without a firm prior the fit cannot tell the prefill's cost from
# the fixed cost (measured at 8 chats/s on a 2-core CPU: 0.44-0.8 ms a token fitted against 1.4 ms measured).
PROBED_PRIOR_WEIGHT = 8.0


def _probe(
    rows: int, context: int, prefill: int, block_size: int, num_blocks: int, max_model_len: int
) -> SchedulerOutput:
    """`rows` decode rows each reading `context` tokens and one prefill chunk of `prefill` tokens (either may be
    0), all in the pool's first blocks: before any request, what they read and write is garbage of the right
    shape."""
    context = min(context, max_model_len, num_blocks * block_size)
    prefill = min(prefill, max_model_len, num_blocks * block_size)
    chunks = [
        ScheduledRequest(
            request_id=f"step-probe-{i}",
            token_ids=(0,),
            start=context - 1,
            num_tokens=1,
            block_table=tuple(range(-(-context // block_size))),
            slots=(context - 1,),
            num_samples=1,
            sample_ids=(f"step-probe-{i}",),
        )
        for i in range(rows)
    ]
    if prefill:  # the preemption probe's prefill chunk
        chunks.append(_probe_step(prefill, block_size).scheduled[0])
    return SchedulerOutput(tuple(chunks), (), (), (), (), (), rows + prefill)


def measure_step_prior(
    executor: Executor, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int
) -> tuple[float, float, float, float]:
    """The step-time model's coefficients (a, b, c, d) fitted to probe steps on the engine's model (before any
    request): decode steps of 1 to 32 rows at two context lengths, prefill chunks of 64 and 256 tokens, and both
    at once. The adaptive policy starts from them instead of a generic prior."""
    block_size = executor.driver.kv_cache.shape.block_size
    num_blocks, device = executor.num_blocks, executor.driver.device
    fit = StepTimeModel(prior_weight=1e-6)  # the probes decide; the ridge only keeps the solve stable
    for index, (rows, context, prefill) in enumerate(_PROBES):
        rows = min(rows, max_num_seqs, max_num_batched_tokens)
        prefill = min(prefill, max_num_batched_tokens - rows)
        if rows + prefill == 0:
            continue
        step = _probe(rows, context, prefill, block_size, num_blocks, max_model_len)
        if index == 0:
            executor.execute(step, {})  # warm-up
        seconds = _best_seconds(partial(executor.execute, step, {}), device, 2)
        fit.observe(StepSample.of(step, seconds))
    a, b, c, d = fit.coefficients
    return a, b, c, d


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


def probed_step_model(scheduler: Scheduler, executor: Executor) -> StepTimeModel:
    """The adaptive policy's step-time model, its prior measured by the probes (logged)."""
    prior = measure_step_prior(
        executor, scheduler.max_num_batched_tokens, scheduler.max_model_len, scheduler.config.max_num_seqs
    )
    logger.info(
        "adaptive scheduling: a step takes %.3g ms + %.3g ms a decode row + %.3g ms a prefill token + %.3g ms per "
        "1,000 context tokens (measured at start)",
        *(value * 1e3 for value in prior),
    )
    return StepTimeModel(prior=prior, prior_weight=PROBED_PRIOR_WEIGHT)
