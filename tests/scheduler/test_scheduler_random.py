"""Seeded random workloads (hypothesis): arrivals, aborts, priorities, n > 1, tiny pools, chunk sizes, policies.

Every step checks the allocator's and the scheduler's invariants, the budgets, the seat and partial-prefill
limits and "no admission in a step that preempted" (under the priority policy: none but of requests ranking
before every victim); at the end every block is free and every sample has exactly its reference tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import (
    FCFSPolicy,
    PreemptionMode,
    PriorityPolicy,
    Request,
    RequestRejectedError,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulingPolicy,
    StaticBatchPolicy,
)
from pagoda.scheduler.testing import (
    SimSamplingParams,
    ThresholdPreemptionCosts,
    TokenCacheModel,
    reference_output,
    run_to_completion,
)

MAX_LEN = 40
PREFIXES: tuple[list[int], ...] = (
    [],
    [3, 1, 4, 1, 5, 9, 2, 6],
    [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5],
)


@dataclass(frozen=True)
class Arrival:
    """One request of a scenario."""

    step: int
    prompt: tuple[int, ...]
    params: SimSamplingParams
    abort_step: int | None


@dataclass(frozen=True)
class Scenario:
    """A configuration, a pool and a workload."""

    config: SchedulerConfig
    block_size: int
    num_blocks: int
    num_host_blocks: int
    policy: str
    static_batch: int
    static_timeout: float
    min_swap_blocks: int  # the forced cost model of preemption_mode "auto"
    arrivals: tuple[Arrival, ...]


@st.composite
def arrivals(draw: st.DrawFn) -> Arrival:
    """A request sharing one of a few prompt prefixes (so the prefix cache gets hits)."""
    prompt = (*draw(st.sampled_from(PREFIXES)), *draw(st.lists(st.integers(0, 9), min_size=1, max_size=8)))
    max_tokens = draw(st.integers(1, min(12, MAX_LEN - len(prompt))))
    stop = draw(st.lists(st.integers(0, 63), max_size=2))
    params = SimSamplingParams(
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, 3)),
        n=draw(st.sampled_from([1, 1, 1, 2, 3])),
        stop_token_ids=tuple(stop),
        priority=draw(st.integers(0, 2)),
    )
    return Arrival(draw(st.integers(0, 15)), prompt, params, draw(st.none() | st.integers(0, 40)))


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """Small limits so preemption, chunking and seat limits all happen."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    chunked = draw(st.booleans())
    mode: PreemptionMode = draw(st.sampled_from(get_args(PreemptionMode)))
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 48) if chunked else st.integers(MAX_LEN, 64)),
        max_model_len=MAX_LEN,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.none() | st.integers(1, 16)),
        max_num_partial_prefills=draw(st.none() | st.integers(1, 3)),
        max_batch_prefill_tokens=draw(st.none() | st.integers(1, 24)) if chunked else None,
        enable_prefix_caching=draw(st.booleans()),
        preemption_mode=mode,
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1])),
    )
    largest = -(-(MAX_LEN - 1) // block_size)  # blocks of the longest possible sequence
    return Scenario(
        config=config,
        block_size=block_size,
        num_blocks=draw(st.integers(largest // 2, 3 * largest)),
        num_host_blocks=draw(st.integers(0, 2 * largest)) if mode != "recompute" else 0,
        policy=draw(st.sampled_from(["fcfs", "priority", "static"])),
        static_batch=draw(st.integers(1, 4)),
        static_timeout=draw(st.sampled_from([0.0, 3.0])),
        min_swap_blocks=draw(st.integers(1, largest)),
        arrivals=tuple(draw(st.lists(arrivals(), min_size=1, max_size=10))),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(scenarios())
def test_random_workloads_keep_every_invariant_and_produce_the_reference_tokens(sc: Scenario) -> None:
    """The whole life of a random workload under random limits, checked step by step and token by token."""
    cfg = sc.config
    kv = BlockManager(
        sc.num_blocks,
        sc.block_size,
        num_host_blocks=sc.num_host_blocks,
        enable_prefix_caching=cfg.enable_prefix_caching,
    )
    now = [0]
    policies: dict[str, SchedulingPolicy] = {
        "fcfs": FCFSPolicy(),
        "priority": PriorityPolicy(),
        "static": StaticBatchPolicy(sc.static_batch, sc.static_timeout, clock=lambda: float(now[0])),
    }
    costs = ThresholdPreemptionCosts(sc.min_swap_blocks) if cfg.preemption_mode == "auto" else None
    sched = Scheduler(cfg, kv, policies[sc.policy], costs)
    model = TokenCacheModel(sc.num_blocks, sc.block_size, sc.num_host_blocks)
    accepted: dict[str, Request] = {}
    aborted: list[Request] = []
    running_before: set[str] = set()

    def before_step(step: int) -> None:
        now[0] = step
        for i, a in enumerate(sc.arrivals):
            if a.step == step:
                request = Request(f"r{i}", a.prompt, a.params, arrival_time=float(step))
                try:
                    sched.add_request(request)
                except RequestRejectedError:
                    need = -(-(len(a.prompt) + a.params.max_tokens - 1) // sc.block_size)
                    assert need > sc.num_blocks or a.params.n > cfg.max_num_seqs
                else:
                    accepted[request.request_id] = request
            if a.abort_step == step:
                aborted.extend(sched.abort_request(f"r{i}"))
        running_before.clear()
        running_before.update(r.request_id for r in sched.running)

    def after_schedule(out: SchedulerOutput) -> None:
        assert (
            out.num_batched_tokens == sum(c.num_tokens for c in out.scheduled) <= sched.max_num_batched_tokens
        )
        assert len(out.scheduled) <= cfg.max_num_seqs and sched.num_running_seqs <= cfg.max_num_seqs
        assert len({c.request_id for c in out.scheduled}) == len(out.scheduled)
        for chunk in out.scheduled:
            assert chunk.num_tokens >= 1
            if cfg.enable_chunked_prefill and cfg.long_prefill_token_threshold is not None:
                assert chunk.num_tokens <= cfg.long_prefill_token_threshold
        # A chunk that is not a decode (one token that samples) is a prefill chunk.
        prefill_chunks = [c for c in out.scheduled if c.num_tokens > 1 or not c.num_samples]
        if cfg.max_num_partial_prefills is not None:
            assert len(prefill_chunks) <= cfg.max_num_partial_prefills
        if cfg.max_batch_prefill_tokens is not None:
            assert sum(c.num_tokens for c in prefill_chunks) <= cfg.max_batch_prefill_tokens
        if out.preempted_request_ids:
            assert not out.blocks_to_swap_in
            admitted = [c.request_id for c in out.scheduled if c.request_id not in running_before]
            if sc.policy != "priority":
                assert not admitted, "admission in a preempting step"
            else:  # a priority preemption makes room for requests that rank before its victims

                def key(rid: str) -> tuple[int, float, int]:
                    r = sched.get_request(rid)
                    assert r is not None
                    return (r.priority, r.arrival_time, r.sample_index)

                first_victim = min(key(v) for v in out.preempted_request_ids)
                assert all(key(a) < first_victim for a in admitted), "admission past a victim"
        sched.check_invariants()
        kv.check_invariants()

    def pending() -> bool:
        return any(a.step > now[0] for a in sc.arrivals)

    result = run_to_completion(
        sched, model, max_steps=5_000, before_step=before_step, after_schedule=after_schedule, pending=pending
    )
    assert kv.num_free_blocks() == kv.num_blocks and kv.num_free_host_blocks() == kv.num_host_blocks
    assert kv.stats().num_used_blocks == 0
    was_aborted = {r.request_id for r in aborted}
    samples = {r.request_id: r for r in (*result.finished, *aborted)}
    assert len(samples) == len(result.finished) + len(aborted)  # nobody finishes twice
    for rid, request in accepted.items():
        for index in range(request.sampling_params.n):
            sid = rid if index == 0 else f"{rid}:{index}"
            if sid not in samples:
                assert rid in was_aborted  # aborted before the fork made this sample
                continue
            sample = samples[sid]
            expected = reference_output(request.prompt_token_ids, request.sampling_params, MAX_LEN, index)
            got = list(sample.output_token_ids)
            if sid in was_aborted:
                assert got == expected[: len(got)]
            else:
                assert got == expected, sid
                assert sample.finish_reason in ("stop", "length")
