"""`adaptive`: a scheduling policy that chooses each step's shape from a cost model of the step and the SLOs.

Every step the scheduler asks its `StepPlanner` (this policy) for a `StepShape`: the token budget, the prefill
chunk cap and the running batch's seats, all at most the configured ceilings. After the step the engine reports
the step's measured wall time (`Scheduler.record_step`), which the policy feeds to its `StepTimeModel`.

The choice, per step (times from the cost model):

1. **TPOT**: every decoding stream may take a step of at most `allowance = first_token + tpot * n - now`
   (n outputs so far: after the step its mean gap is still within its target), plus, while no prompt is queued or
   prefilling, the slack its next (up to 8) decode-only steps will bank if they are shorter than its target (TPOT
   is a mean over the stream), capped at 3 x its target so that slack is spent gradually. (With prompts queued
   the next steps carry prefill too and bank nothing: borrowing there let every step run long under load.) The
   step's time limit is the least allowance; the prefill tokens that fit beside the decodes in it are `room`.
2. **TTFT**: for the prompts in queue order (running prefills, then waiting), the k-th must finish its
   remaining tokens (with those before it) by its deadline: prefill rate `need_k` per step. Prompts whose
   deadline no rate can meet any more are lost: they stop driving the budget, their tokens no longer count
   ahead of the prompts behind them, and they queue behind the others; a lost prompt already running (scheduled
   before any waiting one) has its chunks capped at half the planned prefill while others can still make it.
3. `need <= room`: the step computes `room` prefill tokens (throughput within every stream's TPOT). Otherwise
   both cannot hold: it keeps whichever side fewer sequences would miss (ties keep TPOT), takes `need` or
   `room` accordingly and counts the sacrifice (`sacrificed["ttft" | "tpot"]`, steps). TPOT is given up only
   while such conflicts are rare (`pressure`, the share of recent steps that had one, below 0.3): under a
   sustained overload the prompts saved would join a batch that cannot keep their TPOT either, and a request
   counts (goodput) only when it meets both, so the streams are kept and the queue sheds the prompts whose
   TTFT is lost (simulated, `tools/simulate_adaptive.py`: chats at 8/s on a 2-core CPU's step costs, 59 of 184
   met both before these rules, 155 after).
4. **Seats**: the running batch holds at most the decode rows that a step with a minimal prefill carries within
   the tightest TPOT target of its streams (lost ones included: a stream that joins would get such a target);
   past them, only when more waiting prompts can still meet their TTFT than running streams their TPOT, while
   conflicts are rare, and requests past the aging bound.

A stream whose TPOT is lost already (its allowance is below a decode-only step) and a prompt whose TTFT is lost
stop weighing in these counts: keeping one lost objective never costs one that can still be met.

The plan aims at each objective less a `headroom` share (10%): the scheduler does not see the HTTP path before a
request arrives, a token's delivery after its step, nor its cost model's error, and a plan made to the objective
itself served requests just past it (2.5-2.8 s for a 2.5 s TTFT at 10 chats/s on a 2-core CPU).

Without a TPOT target a stream's target is the TPOT the `latency` profile would give on this machine: the
modelled time of a step of min(batch, its seats) decodes and one of its prefill chunks. Prompts always advance by
at least `min_prefill` tokens a step (the latency chunk when no stream can still meet its TPOT), so no prompt
starves; a request waiting `max(10 s, 4 x TTFT)` goes first
whatever its deadline, except that of those whose TTFT was lost before, one at a time does (the lane): under a
sustained overload they would otherwise crowd out the prompts that can still make it, and serving them late
meets nothing. Queue order is (priority class when `scheduling_policy` is "priority", deadline).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pagoda.scheduler.config import SchedulerConfig
from pagoda.scheduler.cost_model import StepSample, StepTimeModel
from pagoda.scheduler.profiles import PRESETS, ProfilePreset
from pagoda.scheduler.request import Request
from pagoda.scheduler.slo import SLOName, SLOTracker

# Waiting this long (or 4 x its TTFT target, if longer) puts a request first in the queue: no starvation.
_AGING_S = 10.0
# The cap on a stream's banked slack, in multiples of its TPOT target.
_MAX_ALLOWANCE = 3.0
# A stream may borrow the slack its next this-many decode-only steps will bank (each shorter than its target):
# its mean gap, what TPOT measures, recovers by its end.
_BORROW_STEPS = 8
# The weight of each step in `pressure`, and the pressure from which TPOT is no longer given up for TTFT.
_PRESSURE_WEIGHT = 0.1
_MAX_PRESSURE = 0.3
# The share of each objective the plan keeps for what the scheduler does not see: the HTTP path and tokenization
# before a request's arrival, the delivery of a token after its step, the error of the step-time model. Planning
# to the objective itself put the served chats' TTFT at 2.5-2.8 s for 2.5 s and TPOT at 145-148 ms for 150 (a
# 2-core CPU at 10 chats/s): requests met the plan and missed the objective by a hair.
HEADROOM = 0.1


@dataclass(frozen=True, slots=True)
class _QueueGroups:
    """Waiting requests by urgency: past the aging bound (first), whose TTFT can still be met, past the aging bound
    with their TTFT lost (behind the live ones but for the lane's one), and lost."""

    aged: list[Request]
    live: list[Request]
    aged_lost: list[Request]
    lost: list[Request]


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step may do: tokens in all, tokens of one prefill chunk, sequences in the running batch."""

    token_budget: int
    chunk_size: int
    max_num_seqs: int


@runtime_checkable
class StepPlanner(Protocol):
    """A policy that shapes each step and learns from the measured ones (the scheduler calls these)."""

    slo: SLOTracker

    def plan_step(
        self, running: Sequence[Request], waiting: Sequence[Request], config: SchedulerConfig
    ) -> StepShape:
        """The shape of the next step, within `config`'s ceilings."""
        ...

    def observe_step(self, sample: StepSample, running: Sequence[Request]) -> None:
        """A step ran: its shape and wall time; `running` after its update."""
        ...

    def request_finished(self, request: Request, *, aborted: bool) -> None:
        """A sequence finished (or was aborted)."""
        ...


class AdaptivePolicy:
    """The `adaptive` profile: a `SchedulingPolicy` and a `StepPlanner` (module docstring)."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        latency: ProfilePreset = PRESETS["latency"],
        model: StepTimeModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        min_prefill: int = 32,
        headroom: float = HEADROOM,
    ) -> None:
        """`latency`: the latency profile's knobs (scaled to the pool) whose TPOT is the default target;
        `clock`: the clock of `Request.arrival_time`; `headroom`: the share of each objective the plan keeps
        (`HEADROOM`)."""
        if not 0.0 <= headroom < 1.0:
            raise ValueError(f"headroom must be in [0, 1), got {headroom}")
        self.aim = 1.0 - headroom
        self.model = model or StepTimeModel()
        self.clock = clock
        self.latency = latency
        self.min_prefill = min_prefill
        self.by_priority = config.scheduling_policy == "priority"
        self.slo = SLOTracker(config.slo_ttft_ms, config.slo_tpot_ms)
        self.last_shape: StepShape | None = None
        self.sacrificed: dict[SLOName, int] = {"ttft": 0, "tpot": 0}
        # How often recent steps could not keep both objectives: a moving average of 0 (both held) or 1.
        self.pressure = 0.0
        # Whether a request whose TTFT was lost before it aged is running (the lane: one such at a time goes
        # ahead of the live prompts, so none starves and the lost ones do not crowd out prompts that can still
        # make it; measured at 10 chats/s: 96-102 of 214 chats were served 10-12 s late ahead of live ones).
        self._lane_busy = False

    # ------------------------------------------------------------ queue order

    def _targets(self, request: Request) -> tuple[float | None, float | None]:
        """The (TTFT, TPOT) the plan aims at: `request`'s objectives less the headroom (None where it has none)."""
        ttft, tpot = self.slo.targets(request)
        return (
            None if ttft is None else ttft * self.aim,
            None if tpot is None else tpot * self.aim,
        )

    def _deadline(self, request: Request) -> float:
        """When its first token is due (arrival + TTFT target; far off without one)."""
        ttft = self._targets(request)[0]
        return request.arrival_time + (ttft if ttft is not None else 3600.0)

    def _key(self, request: Request) -> tuple[int, float, float, int]:
        return (
            request.priority if self.by_priority else 0,
            self._deadline(request),
            request.arrival_time,
            request.sample_index,
        )

    def enqueue(self, queue: list[Request], request: Request, *, preempted: bool) -> None:
        """Insert by (class, deadline, arrival): a preempted request keeps its deadline, so it returns early."""
        bisect.insort_right(queue, request, key=self._key)

    @staticmethod
    def _aged(ttft: float | None, since: float) -> bool:
        """Whether a request with planned TTFT `ttft`, waiting for its first token `since` arrival (seconds), is past
        the aging bound."""
        return since >= max(_AGING_S, 4 * (ttft or 0.0))

    def _queue_groups(self, waiting: Sequence[Request], now: float) -> _QueueGroups:
        """The waiting requests by urgency (`_QueueGroups`), each group in queue order."""
        groups = _QueueGroups([], [], [], [])
        for request in waiting:
            ttft = self._targets(request)[0]
            waited = now - request.arrival_time
            lost = ttft is not None and waited > ttft and not request.num_output_tokens
            if self._aged(ttft, waited):
                (groups.aged_lost if lost else groups.aged).append(request)
            elif lost:
                groups.lost.append(request)
            else:
                groups.live.append(request)
        if groups.aged_lost and not self._lane_busy:  # the lane's next request goes first
            groups.aged.append(groups.aged_lost.pop(0))
        return groups

    def admissible(
        self, waiting: Sequence[Request], num_running_seqs: int, max_num_seqs: int
    ) -> Sequence[Request]:
        """Aged requests (of those whose TTFT is lost, one at a time: the lane), then those whose TTFT can still be
        met, then the other lost ones; each group in queue order."""
        groups = self._queue_groups(waiting, self.clock())
        if not (groups.aged or groups.aged_lost or groups.lost):
            return waiting
        return [*groups.aged, *groups.live, *groups.aged_lost, *groups.lost]

    def select_victim(self, candidates: Sequence[Request]) -> Request:
        """The least urgent class, then the latest deadline (ties: the latest admitted)."""
        if not candidates:
            raise ValueError("no preemption candidates")
        return max(reversed(candidates), key=self._key)

    def preempt_for(self, request: Request, running: Sequence[Request]) -> Request | None:
        """Under the priority order, the least urgent running request of a later class (vLLM's rule)."""
        if not self.by_priority or not running:
            return None
        victim = max(reversed(running), key=self._key)
        return victim if victim.priority > request.priority else None

    # --------------------------------------------------------------- planning

    def _latency_chunk(self) -> int:
        """The latency profile's prefill chunk."""
        return self.latency.long_prefill_token_threshold or self.latency.max_num_batched_tokens

    def _tpot_target(self, decodes: int, context_per_row: float) -> float:
        """The default TPOT: the latency profile's modelled step (its seats of decodes and one chunk)."""
        rows = min(max(decodes, 1), self.latency.max_num_seqs)
        chunk = self.latency.long_prefill_token_threshold or self.latency.max_num_batched_tokens
        chunk = min(chunk, max(self.latency.max_num_batched_tokens - rows, 0))
        return self.model.predict(rows, chunk, int(rows * context_per_row) + chunk)

    def _in_lane(self, request: Request, now: float) -> bool:
        """Whether running `request` had its TTFT lost past the aging bound (so it holds the lane)."""
        ttft = self._targets(request)[0]
        if ttft is None:
            return False
        first = self.slo.first_token_time.get(request.request_id)
        return self._aged(ttft, (now if first is None else first) - request.arrival_time)

    def plan_step(
        self, running: Sequence[Request], waiting: Sequence[Request], config: SchedulerConfig
    ) -> StepShape:
        """The next step's budget, chunk and seats (module docstring)."""
        assert config.max_num_batched_tokens is not None
        ceiling = config.max_num_batched_tokens
        now = self.clock()
        self._lane_busy = any(self._in_lane(r, now) for r in running)
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        num_rows = len(decodes) + sum(len(r.spec_token_ids) for r in decodes)
        context = sum(r.num_tokens for r in decodes)
        per_row = context / len(decodes) if decodes else 0.0
        default_tpot = self._tpot_target(len(decodes), per_row)
        # 1. TPOT: the step's time limit from each stream's allowance. A stream that cannot make its target
        # any more (its allowance is below even a decode-only step) is lost: it limits the step to its target
        # (so that the others still can) but never counts as a stream a longer step would make miss.
        allowances: list[float] = []  # of the streams that can still meet their TPOT
        limit = math.inf
        decode_step = self.model.predict(num_rows, 0, context)
        for request in decodes:
            tpot = self._targets(request)[1] or default_tpot
            first = self.slo.first_token_time.get(request.request_id)
            allowance = tpot if first is None else first + tpot * request.num_output_tokens - now
            if not prefills and not waiting:  # its next steps are decode-only: they will bank slack
                ahead = request.sampling_params.max_tokens - request.num_output_tokens - 1
                allowance += max(0.0, tpot - decode_step) * min(max(ahead, 0), _BORROW_STEPS)
            allowance = min(allowance, _MAX_ALLOWANCE * tpot)
            if allowance < decode_step:
                limit = min(limit, tpot)
            else:
                allowances.append(allowance)
                limit = min(limit, allowance)
        room = ceiling if math.isinf(limit) else self.model.prefill_room(limit, num_rows, context)
        # 2. TTFT: the prefill rate each prompt's deadline needs, with the prompts before it.
        a, b, c, d = self.model.coefficients
        fixed = a + b * num_rows + d * context / 1000.0
        wants: list[int] = []
        total = 0
        pending = [*prefills, *waiting]
        lost_running = False  # whether a running prefill's TTFT is lost (running ones come first in a step)
        for index, request in enumerate(pending):
            remaining = request.num_tokens - request.num_computed_tokens
            ttft = self._targets(request)[0]
            if ttft is None or request.num_output_tokens:
                total += remaining
                continue
            slack = request.arrival_time + ttft - now - fixed - (total + remaining) * c
            if slack > 0:
                total += remaining
                wants.append(math.ceil(total * fixed / slack))
            elif index < len(prefills):  # lost (no rate meets it): it no longer delays those behind it
                lost_running = True
        need = max(wants, default=0)
        # 3. Both, or the side fewer sequences miss (a step without decodes has no TPOT to keep).
        prefill = room
        conflict = need > room and bool(decodes)
        self.pressure += _PRESSURE_WEIGHT * (conflict - self.pressure)
        if conflict:
            step_s = self.model.predict(num_rows, need, context + need)
            missed_tpot = sum(step_s > allowance for allowance in allowances)
            missed_ttft = sum(rate > room for rate in wants)
            # Under sustained pressure (overload) a prompt saved now joins a batch that cannot keep its own
            # TPOT either, and goodput needs both: the streams are kept.
            if missed_tpot < missed_ttft and self.pressure < _MAX_PRESSURE:
                prefill = need
                self.sacrificed["tpot"] += missed_tpot > 0
            else:
                self.sacrificed["ttft"] += 1
        # Prompts always advance: by `min_prefill` beside decoding streams, else by at least the latency profile's
        # chunk, so that a lost long prompt does not crawl ahead of the prompts queued behind it. (Streams whose
        # TPOT is lost still bound the step: dropping that bound once all were lost let every prompt in at full
        # speed, and every new stream missed its TPOT in turn; measured at 8 chats/s.)
        floor = self.min_prefill if decodes else max(self.min_prefill, self._latency_chunk())
        if pending:
            prefill = max(prefill, floor)
        budget = max(1, min(ceiling, num_rows + prefill))
        chunk = max(1, min(budget, max(prefill, floor)))
        if lost_running and wants:
            # A running prefill whose TTFT is lost is scheduled before the waiting prompts that can still meet
            # theirs: cap every chunk at what the step plans for those (at least the floor), so the lost one takes
            # a share of the budget and the rest goes to them.
            chunk = max(1, min(chunk, max(floor, need // 2)))
        # 4. Seats: the decode rows a step with a minimal prefill carries within the tightest TPOT target of the
        # batch; past them, only when the prompts that can still meet their TTFT outnumber the streams that can
        # still meet their TPOT while conflicts are rare (as in 3), and for requests past the aging bound.
        seats = config.max_num_seqs
        if decodes:
            # A stream that joins gets a target like theirs (lost ones included: their targets still say what a
            # stream of this batch needs), so the batch stays within the tightest of them with a minimal prefill.
            target = min(self._targets(r)[1] or default_tpot for r in decodes)
            fit = self.model.decode_rows_within(target, self.min_prefill, per_row, config.max_num_seqs)
            groups = self._queue_groups(waiting, now)
            # Past the fit, prompts that can still meet their TTFT may join only when they outnumber the streams
            # that can still meet their TPOT and conflicts are rare (as in 3); aged requests always get a seat.
            if not (len(groups.live) > len(allowances) and self.pressure < _MAX_PRESSURE):
                seats = max(fit, len(running) + len(groups.aged))
        seats = max(1, min(config.max_num_seqs, seats))
        if not config.enable_chunked_prefill or any(r.encoder_spans for r in pending):
            budget, chunk = ceiling, ceiling  # a whole prompt (or an atomic image) must fit one step
        self.last_shape = StepShape(budget, chunk, seats)
        return self.last_shape

    def observe_step(self, sample: StepSample, running: Sequence[Request]) -> None:
        """Feed the cost model; note the first tokens this step produced."""
        self.model.observe(sample)
        self.slo.first_tokens(running, self.clock())

    def request_finished(self, request: Request, *, aborted: bool) -> None:
        """Count its SLOs (not for an abort) and forget it."""
        self.slo.finished(request, self.clock(), aborted=aborted)
