"""The scheduler over a BlockManager with KV cache groups (a full group and sliding-window groups): random
workloads with chunked prefill, prefix caching, preemption by recompute and swap, and n > 1 forks keep every
invariant, each group's window reads back the right tokens, decodes hold at most ceil(W / block_size) + 1 blocks
in a sliding group, and every sample gets its reference tokens."""

from __future__ import annotations

from typing import get_args

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagoda.blockalloc import FULL_ATTENTION, BlockManager, KVCacheGroupSpec
from pagoda.scheduler import (
    PreemptionMode,
    Request,
    RequestRejectedError,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from pagoda.scheduler.testing import SimSamplingParams, TokenCacheModel, reference_output, run_to_completion

MAX_LEN = 48
PREFIX = [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3, 5, 3, 6]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    windows=st.lists(st.integers(1, 12), min_size=1, max_size=2),
    chunk=st.integers(1, 24),
    caching=st.booleans(),
    mode=st.sampled_from(get_args(PreemptionMode)),
    num_blocks=st.integers(12, 60),
    prompts=st.lists(
        st.tuples(
            st.integers(0, 20), st.lists(st.integers(0, 9), min_size=1, max_size=16), st.integers(1, 14)
        ),
        min_size=1,
        max_size=8,
    ),
    n=st.sampled_from([1, 1, 2]),
)
def test_grouped_workloads_keep_invariants_and_reference_tokens(
    block_size: int,
    windows: list[int],
    chunk: int,
    caching: bool,
    mode: PreemptionMode,
    num_blocks: int,
    prompts: list[tuple[int, list[int], int]],
    n: int,
) -> None:
    """Every step: scheduler and allocator invariants, per-group windows, the decode bound; at the end: all free."""
    groups = (FULL_ATTENTION, *(KVCacheGroupSpec(sliding_window=w) for w in windows))
    kv = BlockManager(
        num_blocks, block_size, num_host_blocks=num_blocks // 2, enable_prefix_caching=caching, groups=groups
    )
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=chunk,
        max_model_len=MAX_LEN,
        enable_prefix_caching=caching,
        preemption_mode="recompute" if mode == "auto" else mode,
    )
    sched = Scheduler(config, kv)
    model = TokenCacheModel(num_blocks, block_size, num_blocks // 2, sliding_windows=(None, *windows))
    accepted: dict[str, Request] = {}
    for i, (prefix_len, suffix, max_tokens) in enumerate(prompts):
        prompt = (*PREFIX[:prefix_len], *suffix)
        params = SimSamplingParams(max_tokens=min(max_tokens, MAX_LEN - len(prompt)), n=n)
        request = Request(f"r{i}", prompt, params, arrival_time=float(i))
        try:
            sched.add_request(request)
        except RequestRejectedError:
            assert (
                kv.blocks_for_tokens(len(prompt) + params.max_tokens - 1, chunk_tokens=chunk) > kv.num_blocks
            )
        else:
            accepted[request.request_id] = request

    def after_schedule(out: SchedulerOutput) -> None:
        sched.check_invariants()
        kv.check_invariants()
        for c in out.scheduled:
            assert len(c.group_block_tables) == len(groups) == len(c.group_slots)
            if c.num_tokens == 1:
                for w, table in zip(windows, c.group_block_tables[1:], strict=True):
                    assert sum(1 for b in table if b != 0) <= -(-w // block_size) + 1

    result = run_to_completion(sched, model, max_steps=5_000, after_schedule=after_schedule)
    assert kv.num_free_blocks() == kv.num_blocks and kv.num_free_host_blocks() == kv.num_host_blocks
    samples = {r.request_id: r for r in result.finished}
    for rid, request in accepted.items():
        for index in range(n):
            sid = rid if index == 0 else f"{rid}:{index}"
            expected = reference_output(request.prompt_token_ids, request.sampling_params, MAX_LEN, index)
            assert list(samples[sid].output_token_ids) == expected, sid


def test_stats_report_usage_per_group_and_one_group_reports_none() -> None:
    """SchedulerStats.kv_usage_per_group: one entry per group with several groups, empty with one."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    grouped = BlockManager(31, 4, groups=(FULL_ATTENTION, KVCacheGroupSpec(sliding_window=4)))
    sched = Scheduler(config, grouped)
    sched.add_request(Request("a", tuple(range(40)), SimSamplingParams(max_tokens=2), arrival_time=0.0))
    out = sched.schedule()
    assert sched.stats().kv_usage_per_group == (10 / 30, 10 / 30)
    sched.update_from_output(out, {"a": [1]})
    out = sched.schedule()  # the decode at 40 releases the local blocks before position 37
    assert sched.stats().kv_usage_per_group == (11 / 30, 2 / 30)
    assert out.scheduled[0].group_block_tables[1][:9] == (0,) * 9
    plain = Scheduler(config, BlockManager(20, 4))
    assert plain.stats().kv_usage_per_group == ()
