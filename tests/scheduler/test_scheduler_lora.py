"""The max_loras cap: a step never runs more distinct adapters than the cap, base-model requests are never held
for it, and a request for another adapter is not starved by a steady stream of requests for the running ones."""

from __future__ import annotations

from typing import Any

import pytest
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import Request, Scheduler, SchedulerConfig, SchedulerOutput
from pagoda.scheduler.testing import SimSamplingParams, TokenCacheModel

BS = 4


def make(**config: Any) -> tuple[Scheduler, TokenCacheModel]:
    """A scheduler with room for everything but the adapter cap."""
    cfg = SchedulerConfig(**{"max_model_len": 64, "watermark": 0.0, **config})
    kv = BlockManager(256, BS, enable_prefix_caching=cfg.enable_prefix_caching)
    return Scheduler(cfg, kv), TokenCacheModel(256, BS)


def lora_req(rid: str, lora_id: int | None, max_tokens: int = 4) -> Request:
    """A 6-token request under adapter `lora_id` (None: the base model)."""
    base = 100 * (sum(map(ord, rid)) % 500)
    return Request(
        rid, list(range(base, base + 6)), SimSamplingParams(max_tokens=max_tokens), lora_id=lora_id
    )


def step(sched: Scheduler, model: TokenCacheModel) -> SchedulerOutput:
    """One schedule + execute + update."""
    out = sched.schedule()
    sched.update_from_output(out, model.execute(out))
    return out


def adapters(out: SchedulerOutput) -> set[int]:
    """Distinct adapters of a step's chunks."""
    return {c.lora_id for c in out.scheduled if c.lora_id is not None}


def test_chunks_carry_their_adapter() -> None:
    """Every scheduled chunk names its request's adapter (None for the base model)."""
    sched, model = make()
    sched.add_request(lora_req("a", 7))
    sched.add_request(lora_req("b", None))
    out = step(sched, model)
    assert {c.request_id: c.lora_id for c in out.scheduled} == {"a": 7, "b": None}


def test_a_step_never_exceeds_max_loras_and_base_requests_pass() -> None:
    """With max_loras=2, requests for three adapters: two run, the third waits; base requests run at once."""
    sched, model = make(max_loras=2)
    for rid, lora in (("r1", 1), ("r2", 2), ("r3", 3), ("base", None)):
        sched.add_request(lora_req(rid, lora))
    first = step(sched, model)
    assert adapters(first) == {1, 2}
    assert "base" in {c.request_id for c in first.scheduled}
    seen_3 = False
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        out = step(sched, model)
        assert len(adapters(out)) <= 2
        seen_3 |= 3 in adapters(out)
    assert seen_3 and not sched.has_unfinished_requests()


@pytest.mark.parametrize("max_loras", [1, 2])
def test_a_new_adapter_is_not_starved_by_a_stream_of_running_ones(max_loras: int) -> None:
    """Requests for the running adapters keep arriving every step; the request for another adapter still runs
    within a bounded number of steps (once the running requests ahead of it finish)."""
    sched, model = make(max_loras=max_loras)
    for lora in range(1, max_loras + 1):
        sched.add_request(lora_req(f"first-{lora}", lora))
    step(sched, model)
    sched.add_request(lora_req("starved", 99))
    started_at = None
    for i in range(30):
        for lora in range(1, max_loras + 1):  # a steady stream for the running adapters
            sched.add_request(lora_req(f"more-{i}-{lora}", lora))
        out = step(sched, model)
        assert len(adapters(out)) <= max_loras
        if any(c.request_id == "starved" for c in out.scheduled):
            started_at = i
            break
    assert started_at is not None and started_at <= 6, started_at


def test_max_loras_validation() -> None:
    """max_loras must be None or >= 1."""
    with pytest.raises(ValueError, match="max_loras"):
        SchedulerConfig(max_loras=0)
