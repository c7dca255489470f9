"""SchedulerConfig is the scheduler section of the server's config: it names the policy the Scheduler builds,
may leave the model-derived limits to its embedder (None), and the Scheduler refuses it until they are set."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import FCFSPolicy, PriorityPolicy, Scheduler, SchedulerConfig, StaticBatchPolicy


@pytest.mark.parametrize(
    ("name", "policy"), [("fcfs", FCFSPolicy), ("priority", PriorityPolicy), ("static", StaticBatchPolicy)]
)
def test_the_scheduler_builds_the_configured_policy(name: str, policy: type) -> None:
    """Without a policy argument the Scheduler builds `scheduling_policy` (static with its timeout)."""
    config = SchedulerConfig(scheduling_policy=name, static_batch_timeout_s=0.25)  # type: ignore[arg-type]
    scheduler = Scheduler(config, BlockManager(16, 4))
    assert type(scheduler.policy) is policy
    if isinstance(scheduler.policy, StaticBatchPolicy):
        assert scheduler.policy.timeout_s == 0.25


def test_unset_limits_are_filled_by_replace_and_validated_then() -> None:
    """None (the embedder derives it) passes validation; the Scheduler needs the values; `replace` validates."""
    unset = SchedulerConfig(max_model_len=None, max_num_batched_tokens=None, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_model_len and max_num_batched_tokens must be set"):
        Scheduler(unset, BlockManager(16, 4))
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_model_len"):
        replace(unset, max_model_len=64, max_num_batched_tokens=32)
    scheduler = Scheduler(replace(unset, max_model_len=64, max_num_batched_tokens=64), BlockManager(16, 4))
    assert (scheduler.max_model_len, scheduler.max_num_batched_tokens) == (64, 64)
