"""Scheduling policies: the `SchedulingPolicy` interface, then FCFS, priority and static batching.

A policy decides queue order, admission and preemption victims. It never touches blocks, budgets or slots
(the scheduler's mechanism); it only orders requests.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from pagoda.scheduler.adaptive import AdaptivePolicy
from pagoda.scheduler.config import SchedulerConfig
from pagoda.scheduler.profiles import PRESETS, scaled_preset
from pagoda.scheduler.request import Request


class SchedulingPolicy(Protocol):
    """Who runs next and who is preempted; the scheduler owns the mechanism (budget, blocks, slots)."""

    def enqueue(self, queue: list[Request], request: Request, *, preempted: bool) -> None:
        """Insert `request` into `queue` (the waiting or the swapped queue) where this policy wants it."""
        ...

    def admissible(
        self, waiting: Sequence[Request], num_running_seqs: int, max_num_seqs: int
    ) -> Sequence[Request]:
        """The waiting requests that may be admitted now, best first; admission stops at the first that does
        not fit."""
        ...

    def select_victim(self, candidates: Sequence[Request]) -> Request:
        """The request to preempt among `candidates` (running requests in running order, never empty)."""
        ...

    def preempt_for(self, request: Request, running: Sequence[Request]) -> Request | None:
        """A running request to preempt so that waiting `request` can be admitted; None: `request` waits."""
        ...


def _arrival_key(request: Request) -> tuple[float, int]:
    """FCFS order: arrival time, then sample index (children after their parent)."""
    return (request.arrival_time, request.sample_index)


def _priority_key(request: Request) -> tuple[int, float, int]:
    """Priority order: lower priority value first, then FCFS."""
    return (request.priority, request.arrival_time, request.sample_index)


def _latest(candidates: Sequence[Request], key: Callable[[Request], tuple[float, ...]]) -> Request:
    """The candidate with the largest key; ties go to the latest in running order (the latest admitted)."""
    if not candidates:
        raise ValueError("no preemption candidates")
    return max(reversed(candidates), key=key)


class FCFSPolicy:
    """First come, first served: admission in arrival order; the latest-arrived running request is preempted.

    A preempted request goes to the FRONT of its queue, so it is readmitted (or swapped in) before newer ones.
    """

    def enqueue(self, queue: list[Request], request: Request, *, preempted: bool) -> None:
        """New requests at the back, preempted ones at the front."""
        if preempted:
            queue.insert(0, request)
        else:
            queue.append(request)

    def admissible(
        self, waiting: Sequence[Request], num_running_seqs: int, max_num_seqs: int
    ) -> Sequence[Request]:
        """Every waiting request, in queue order."""
        return waiting

    def select_victim(self, candidates: Sequence[Request]) -> Request:
        """The latest arrival."""
        return _latest(candidates, _arrival_key)

    def preempt_for(self, request: Request, running: Sequence[Request]) -> Request | None:
        """Nobody: a waiting request waits for blocks and seats to free up."""
        return None


class PriorityPolicy:
    """Lower `priority` value first, FCFS among equals; the victim is the lowest-priority, latest-arrived one.

    Queues stay sorted by (priority, arrival): a preempted request re-enters by its key, not at the front, so
    it never jumps ahead of a more urgent one. A waiting request that cannot be admitted (no seat or no
    blocks) preempts running requests that rank after it, least urgent first, until it fits (vLLM's priority
    preemption).
    """

    def enqueue(self, queue: list[Request], request: Request, *, preempted: bool) -> None:
        """Insert by (priority, arrival), after equal keys."""
        bisect.insort_right(queue, request, key=_priority_key)

    def admissible(
        self, waiting: Sequence[Request], num_running_seqs: int, max_num_seqs: int
    ) -> Sequence[Request]:
        """Every waiting request, most urgent first."""
        return waiting

    def select_victim(self, candidates: Sequence[Request]) -> Request:
        """The least urgent, latest arrival."""
        return _latest(candidates, _priority_key)

    def preempt_for(self, request: Request, running: Sequence[Request]) -> Request | None:
        """The least urgent running request if it ranks after `request` by (priority, arrival) (vLLM's rule)."""
        if not running:
            return None
        victim = _latest(running, _priority_key)
        return victim if _priority_key(victim) > _priority_key(request) else None


class StaticBatchPolicy:
    """Traditional (static) batching, the baseline continuous batching is measured against.

    Waits until `batch_size` sequences are waiting (default: `max_num_seqs`) or the oldest has waited
    `timeout_s` on `clock` (the clock of `Request.arrival_time`), then admits that batch and nothing else
    until every member has finished: no joins. Members that do not fit in KV memory at once wait inside the
    batch and join as earlier members finish; preempted members stay members.
    """

    def __init__(
        self,
        batch_size: int | None = None,
        timeout_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`batch_size` None means the scheduler's `max_num_seqs`."""
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be positive")
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.clock = clock
        self._batch: set[str] = set()  # group ids of the batch in flight

    @property
    def batch(self) -> frozenset[str]:
        """Group ids of the batch in flight (empty between batches)."""
        return frozenset(self._batch)

    def enqueue(self, queue: list[Request], request: Request, *, preempted: bool) -> None:
        """FCFS queues; preempted members go to the front."""
        if preempted:
            queue.insert(0, request)
        else:
            queue.append(request)

    def admissible(
        self, waiting: Sequence[Request], num_running_seqs: int, max_num_seqs: int
    ) -> Sequence[Request]:
        """Members of the batch in flight; or a new batch when none runs and one is due; else nothing."""
        if self._batch:
            members = [r for r in waiting if r.group_id in self._batch]
            if members or num_running_seqs:
                return members
            self._batch.clear()  # every member finished: the next batch may form
        if num_running_seqs or not waiting:
            return []
        size = min(self.batch_size or max_num_seqs, max_num_seqs)
        num_seqs = sum(r.num_seqs for r in waiting)
        oldest = min(r.arrival_time for r in waiting)
        if num_seqs < size and self.clock() - oldest < self.timeout_s:
            return []
        batch: list[Request] = []
        for request in waiting:
            if batch and size < request.num_seqs:  # the first always goes: its n never exceeds max_num_seqs
                break
            size -= request.num_seqs
            batch.append(request)
        self._batch = {r.group_id for r in batch}
        return batch

    def select_victim(self, candidates: Sequence[Request]) -> Request:
        """The latest arrival."""
        return _latest(candidates, _arrival_key)

    def preempt_for(self, request: Request, running: Sequence[Request]) -> Request | None:
        """Nobody: a waiting request waits for blocks and seats to free up."""
        return None


def build_policy(config: SchedulerConfig, *, pool: tuple[int, int] | None = None) -> SchedulingPolicy:
    """The policy `config.scheduling_policy` names (static: batches formed after `static_batch_timeout_s`), or
    the `adaptive` profile's `AdaptivePolicy` (its default TPOT from the latency preset scaled to `pool`, the
    KV pool's (num_blocks, block_size); unscaled without it)."""
    if config.scheduling_profile == "adaptive":
        latency = PRESETS["latency"] if pool is None else scaled_preset("latency", *pool)
        return AdaptivePolicy(config, latency=latency)
    if config.scheduling_policy == "priority":
        return PriorityPolicy()
    if config.scheduling_policy == "static":
        # The policy's clock is time.monotonic, the clock of the engines' arrival times.
        return StaticBatchPolicy(timeout_s=config.static_batch_timeout_s)
    return FCFSPolicy()
