"""Preemption (recompute and swap), aborts in every state, and the three policies, with the real BlockManager."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import (
    FCFSPolicy,
    MeasuredPreemptionCosts,
    PreemptionCostModel,
    PriorityPolicy,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulingPolicy,
    StaticBatchPolicy,
    choose_preemption,
)
from pagoda.scheduler.testing import (
    SimSamplingParams,
    ThresholdPreemptionCosts,
    TokenCacheModel,
    reference_output,
    run_to_completion,
)

BS = 4
MAX_LEN = 64


def make(
    num_blocks: int,
    *,
    num_host_blocks: int = 0,
    policy: SchedulingPolicy | None = None,
    costs: PreemptionCostModel | None = None,
    **config: Any,
) -> tuple[Scheduler, BlockManager, TokenCacheModel]:
    """A scheduler over a real BlockManager, and a token model shaped like it."""
    cfg = SchedulerConfig(**{"max_model_len": MAX_LEN, "watermark": 0.0, **config})
    kv = BlockManager(num_blocks, BS, num_host_blocks=num_host_blocks)
    return Scheduler(cfg, kv, policy, costs), kv, TokenCacheModel(num_blocks, BS, num_host_blocks)


def workload() -> list[Request]:
    """Eight requests of mixed lengths, one with n = 2, distinct prompts."""
    return [
        Request(
            f"r{i}",
            [(7 * i + j) % 50 + 1 for j in range(5 + 3 * i % 17)],
            SimSamplingParams(max_tokens=6 + 5 * i % 23, n=2 if i == 3 else 1),
            arrival_time=float(i),
        )
        for i in range(8)
    ]


def outputs_of(finished: list[Request]) -> dict[str, list[int]]:
    """Output tokens per request id."""
    return {r.request_id: list(r.output_token_ids) for r in finished}


def run(
    sched: Scheduler, kv: BlockManager, model: TokenCacheModel, requests: list[Request]
) -> dict[str, list[int]]:
    """Run `requests` to completion, checking both invariant sets every step; outputs per id."""
    for r in requests:
        sched.add_request(r)

    def check(out: SchedulerOutput) -> None:
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        sched.check_invariants()
        kv.check_invariants()

    result = run_to_completion(sched, model, after_schedule=check)
    assert kv.num_free_blocks() == kv.num_blocks and kv.num_free_host_blocks() == kv.num_host_blocks
    return outputs_of(result.finished)


@pytest.mark.parametrize(("mode", "host_blocks"), [("recompute", 0), ("swap", 64), ("swap", 3)])
def test_a_tiny_pool_preempts_and_still_produces_the_unconstrained_tokens(
    mode: str, host_blocks: int
) -> None:
    """Forced preemptions (recompute, swap, swap falling back to recompute) change no token."""
    free = run(*make(256, max_num_batched_tokens=16), workload())
    sched, kv, model = make(12, num_host_blocks=host_blocks, preemption_mode=mode, max_num_batched_tokens=16)
    tight = run(sched, kv, model, workload())
    assert sched.stats().num_preemptions > 0
    assert tight == free
    for r in workload():
        expected = reference_output(r.prompt_token_ids, r.sampling_params, MAX_LEN)
        assert free[r.request_id] == expected


def test_recompute_preemption_picks_the_latest_arrival_and_admits_nobody_that_step() -> None:
    """The victim goes to the front of the waiting queue with no computed tokens; no admission that step."""
    sched, _, model = make(4)
    a = Request("a", [1, 2, 3, 4, 5, 6, 7], SimSamplingParams(max_tokens=8), arrival_time=0.0)
    b = Request("b", [8, 9, 10, 11, 12, 13, 14], SimSamplingParams(max_tokens=8), arrival_time=1.0)
    c = Request("c", [20, 21, 22], SimSamplingParams(max_tokens=2), arrival_time=2.0)
    for r in (a, b, c):
        sched.add_request(r)
    for _ in range(2):  # prompts (2 blocks each: the pool is full), then the decodes filling the last slot
        out = sched.schedule()
        sched.update_from_output(out, model.execute(out))
    out = sched.schedule()
    assert out.preempted_request_ids == ("b",)
    assert [ch.request_id for ch in out.scheduled] == ["a"]  # c would fit in the freed block but must wait
    assert sched.waiting == [b, c] and b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_output_tokens == 2 and b.num_preemptions == 1
    sched.update_from_output(out, model.execute(out))
    run_to_completion(sched, model)
    assert list(b.output_token_ids) == reference_output(b.prompt_token_ids, b.sampling_params, MAX_LEN)


def test_swap_preemption_moves_blocks_to_the_host_and_back_before_admitting() -> None:
    """Swap mode: the victim's blocks go out as (device, host) pairs and return before waiting ones start."""
    sched, kv, model = make(4, num_host_blocks=8, preemption_mode="swap")
    a = Request("a", [1, 2, 3, 4, 5, 6, 7], SimSamplingParams(max_tokens=8))
    b = Request("b", [8, 9, 10, 11, 12, 13, 14], SimSamplingParams(max_tokens=8))
    for r in (a, b):
        sched.add_request(r)
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_output(out, model.execute(out))
    table = kv.block_table("b")
    out = sched.schedule()
    assert out.preempted_request_ids == ("b",) and sched.swapped == [b]
    stats = sched.stats()
    assert (stats.num_swapped, stats.num_running, stats.num_waiting, stats.num_preemptions) == (1, 1, 0, 1)
    assert [d for d, _ in out.blocks_to_swap_out] == list(table)
    assert b.num_computed_tokens == 8 and kv.is_swapped("b")
    sched.update_from_output(out, model.execute(out))
    sched.add_request(Request("c", [20, 21, 22], SimSamplingParams(max_tokens=2)))
    swapped_in = False
    while sched.has_unfinished_requests():
        out = sched.schedule()
        ids = [ch.request_id for ch in out.scheduled]
        if out.blocks_to_swap_in:
            swapped_in = True
            assert "b" in ids
        if "c" in ids:
            assert swapped_in  # c was admitted only after b came back
        sched.update_from_output(out, model.execute(out))
    assert swapped_in
    assert list(b.output_token_ids) == reference_output(b.prompt_token_ids, b.sampling_params, MAX_LEN)


def test_auto_swaps_long_victims_and_recomputes_short_ones() -> None:
    """On a cost model where swapping pays from 3 blocks on, the 4-block victim is swapped, the 2-block one not."""
    sched, kv, model = make(
        8,
        num_host_blocks=16,
        preemption_mode="auto",
        costs=ThresholdPreemptionCosts(min_swap_blocks=3),
        max_num_batched_tokens=64,
    )
    with pytest.raises(ValueError, match="cost model"):
        make(8, preemption_mode="auto")
    short = Request("short", list(range(1, 8)), SimSamplingParams(max_tokens=8), arrival_time=2.0)
    long = Request("long", list(range(10, 25)), SimSamplingParams(max_tokens=8), arrival_time=1.0)
    first = Request("first", list(range(30, 33)), SimSamplingParams(max_tokens=8), arrival_time=0.0)
    for r in (first, long, short):
        sched.add_request(r)
    out = sched.schedule()  # 1 + 4 + 2 blocks: one block left
    sched.update_from_output(out, model.execute(out))
    swapped, recomputed = set(), set()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        swapped |= {r.request_id for r in sched.swapped}
        recomputed |= {r.request_id for r in sched.waiting if r.status is RequestStatus.PREEMPTED}
        sched.update_from_output(out, model.execute(out))
    assert (swapped, recomputed) == ({"long"}, {"short"})
    for r in (first, long, short):
        assert list(r.output_token_ids) == reference_output(r.prompt_token_ids, r.sampling_params, MAX_LEN)
    assert kv.num_free_blocks() == kv.num_blocks and kv.num_free_host_blocks() == kv.num_host_blocks


def test_measured_costs_make_recompute_win_only_for_short_victims() -> None:
    """The measured model: a fixed copy latency beside linear costs, so the choice flips with the length."""
    costs = MeasuredPreemptionCosts(
        bytes_per_block=1000, host_copy_bytes_per_s=1e6, host_copy_latency_s=0.01, prefill_tokens_per_s=1000
    )
    assert costs.swap_seconds(2) == pytest.approx(2 * (0.01 + 0.002))
    assert choose_preemption(costs, num_blocks=1, num_tokens=16) == "recompute"
    assert choose_preemption(costs, num_blocks=64, num_tokens=1024) == "swap"


def test_priority_admission_preempts_less_urgent_running_requests() -> None:
    """An urgent request that finds the batch full preempts the least urgent running one (by recompute) and
    runs in the same step; a request of equal or lower urgency preempts nobody."""
    sched, kv, model = make(
        16, policy=PriorityPolicy(), max_num_seqs=2, preemption_mode="swap", num_host_blocks=16
    )
    low = Request("low", list(range(1, 6)), SimSamplingParams(max_tokens=10, priority=2), arrival_time=0.0)
    mid = Request("mid", list(range(11, 16)), SimSamplingParams(max_tokens=10, priority=1), arrival_time=1.0)
    for r in (low, mid):
        sched.add_request(r)
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_output(out, model.execute(out))
    later = Request(
        "later", list(range(21, 24)), SimSamplingParams(max_tokens=2, priority=2), arrival_time=2.0
    )
    sched.add_request(later)
    out = sched.schedule()
    assert not out.preempted_request_ids and {c.request_id for c in out.scheduled} == {"low", "mid"}
    sched.update_from_output(out, model.execute(out))
    urgent = Request(
        "urgent", list(range(31, 34)), SimSamplingParams(max_tokens=2, priority=0), arrival_time=3.0
    )
    sched.add_request(urgent)
    out = sched.schedule()
    assert out.preempted_request_ids == ("low",) and not out.blocks_to_swap_out
    assert [c.request_id for c in out.scheduled] == ["mid", "urgent"]
    assert sched.waiting == [low, later] and low.num_computed_tokens == 0
    sched.update_from_output(out, model.execute(out))
    finished = [r.request_id for r in run_to_completion(sched, model).finished]
    assert finished.index("urgent") < finished.index("low")
    for r in (low, mid, later, urgent):
        assert list(r.output_token_ids) == reference_output(r.prompt_token_ids, r.sampling_params, MAX_LEN)
    assert kv.num_free_blocks() == kv.num_blocks


def state_of(kind: str, sched: Scheduler, model: TokenCacheModel) -> Request:
    """Add "x" (n = 2: its two samples need 13 blocks of the 12, so one gets preempted) and step into `kind`."""
    x = Request("x", list(range(40, 52)), SimSamplingParams(max_tokens=20, n=2))
    sched.add_request(x)
    conditions: dict[str, Callable[[], bool]] = {
        "waiting": lambda: True,
        "mid-prefill": lambda: x.num_computed_tokens > 0,
        "running": lambda: sched.get_request("x:1") is not None,
        "swapped": lambda: any(r.group_id == "x" for r in sched.swapped),
        "preempted": lambda: any(r.status is RequestStatus.PREEMPTED for r in sched.waiting),
    }
    reached = conditions[kind]
    for _ in range(40):
        if reached():
            return x
        out = sched.schedule()
        sched.update_from_output(out, model.execute(out))
    raise AssertionError(f"never reached {kind}")


@pytest.mark.parametrize("kind", ["waiting", "mid-prefill", "running", "swapped", "preempted"])
def test_abort_frees_blocks_at_once_in_every_state(kind: str) -> None:
    """abort_request works while waiting, mid-prefill, running (forked), swapped out and recompute-preempted."""
    mode = "swap" if kind == "swapped" else "recompute"
    sched, kv, model = make(12, num_host_blocks=16, preemption_mode=mode, max_num_batched_tokens=8)
    request = state_of(kind, sched, model)
    if kind == "mid-prefill":
        assert (
            request.status is RequestStatus.RUNNING
            and request.num_computed_tokens < request.num_prompt_tokens
        )
    aborted = sched.abort_request("x")
    assert aborted and all(r.status is RequestStatus.FINISHED_ABORTED for r in aborted)
    assert {r.group_id for r in aborted} == {"x"} and len(aborted) == (
        1 if kind in ("waiting", "mid-prefill") else 2
    )
    assert kv.num_free_blocks() == kv.num_blocks and kv.num_free_host_blocks() == kv.num_host_blocks
    assert not sched.has_unfinished_requests()
    sched.check_invariants()
    kv.check_invariants()
    out = sched.schedule()
    assert out.is_empty and {r.request_id for r in aborted} <= set(out.finished_request_ids)
    assert sched.abort_request("x") == []


def test_abort_between_schedule_and_update_is_ignored_by_the_update() -> None:
    """A request aborted while its step runs gets no tokens and is not resurrected."""
    sched, kv, model = make(16)
    sched.add_request(Request("a", [1, 2, 3], SimSamplingParams(max_tokens=4, n=2)))
    out = sched.schedule()
    sched.abort_request("a")
    assert sched.update_from_output(out, model.execute(out)) == []
    assert not sched.has_unfinished_requests() and kv.num_free_blocks() == kv.num_blocks


def test_priority_policy_admits_urgent_first_and_preempts_the_least_urgent() -> None:
    """Lower priority value first at admission; the victim is the least urgent even if it arrived first."""
    sched, _, model = make(4, policy=PriorityPolicy(), max_num_seqs=1)
    low = Request("low", [1, 2, 3], SimSamplingParams(max_tokens=2, priority=5), arrival_time=0.0)
    high = Request("high", [4, 5, 6], SimSamplingParams(max_tokens=2, priority=0), arrival_time=1.0)
    sched.add_request(low)
    sched.add_request(high)
    assert [c.request_id for c in sched.schedule().scheduled] == ["high"]

    sched, _, model = make(4, policy=PriorityPolicy())
    low = Request("low", list(range(1, 8)), SimSamplingParams(max_tokens=8, priority=5), arrival_time=0.0)
    high = Request("high", list(range(11, 18)), SimSamplingParams(max_tokens=8, priority=0), arrival_time=1.0)
    sched.add_request(low)
    sched.add_request(high)
    preempted: list[str] = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        preempted += out.preempted_request_ids
        sched.update_from_output(out, model.execute(out))
    assert preempted and set(preempted) == {"low"}
    for r in (low, high):
        assert list(r.output_token_ids) == reference_output(r.prompt_token_ids, r.sampling_params, MAX_LEN)


def test_static_policy_waits_for_a_full_batch_or_the_timeout_and_allows_no_joins() -> None:
    """Static batching: a batch of 2 forms (or times out), runs to completion, and nobody joins it meanwhile."""
    now = [0.0]
    policy = StaticBatchPolicy(batch_size=2, timeout_s=10.0, clock=lambda: now[0])
    sched, kv, model = make(32, policy=policy)

    def add(rid: str, max_tokens: int) -> None:
        sched.add_request(
            Request(rid, [len(rid), 3, 9], SimSamplingParams(max_tokens=max_tokens), arrival_time=now[0])
        )

    def ids() -> list[str]:
        out = sched.schedule()
        sched.update_from_output(out, model.execute(out))
        return [c.request_id for c in out.scheduled]

    add("a", 2)
    assert ids() == []  # one waiting, no timeout yet
    now[0] = 5.0
    add("bb", 6)
    assert ids() == ["a", "bb"]  # the batch is full
    add("ccc", 2)
    seen = [ids() for _ in range(5)]
    assert seen == [["a", "bb"], ["bb"], ["bb"], ["bb"], ["bb"]]  # a finished early; ccc may not join
    assert policy.batch == {"a", "bb"}
    assert ids() == []  # batch over; ccc alone waits for company or the timeout
    now[0] = 16.0
    assert ids() == ["ccc"]
    run_to_completion(sched, model)
    assert kv.num_free_blocks() == kv.num_blocks


def test_policies_order_queues_and_pick_victims_without_a_scheduler() -> None:
    """FCFS: back/front insertion, latest arrival (ties: latest admitted) is the victim; priority sorts by key."""
    reqs = [
        Request(f"q{i}", [1], SimSamplingParams(priority=p), arrival_time=t)
        for i, (p, t) in enumerate([(2, 0.0), (0, 1.0), (1, 1.0), (0, 2.0)])
    ]
    fcfs, queue = FCFSPolicy(), list[Request]()
    for r in reqs[:3]:
        fcfs.enqueue(queue, r, preempted=False)
    fcfs.enqueue(queue, reqs[3], preempted=True)
    assert [r.request_id for r in queue] == ["q3", "q0", "q1", "q2"]
    assert fcfs.select_victim(reqs[:3]).request_id == "q2"  # q1 and q2 tie on arrival: the later in order
    assert fcfs.admissible(queue, 0, 4) == queue
    prio, queue = PriorityPolicy(), list[Request]()
    for r in reqs:
        prio.enqueue(queue, r, preempted=r.request_id == "q3")
    assert [r.request_id for r in queue] == ["q1", "q3", "q2", "q0"]
    assert prio.select_victim(reqs).request_id == "q0" and prio.select_victim(reqs[1:]).request_id == "q2"
    with pytest.raises(ValueError):
        prio.select_victim([])
    with pytest.raises(ValueError):
        StaticBatchPolicy(batch_size=0)
