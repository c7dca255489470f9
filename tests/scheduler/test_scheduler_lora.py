"""The max_loras cap (the `AdapterCap` admission rule): a step never runs more distinct adapters than the cap,
base-model requests are never held for it, and a request for another adapter is not starved by a steady stream of
requests for the running ones; other admission rules plug in the same way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import (
    AdapterCap,
    AdmissionRule,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    build_rules,
)
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


def test_max_loras_builds_the_adapter_cap_and_none_builds_no_rule() -> None:
    """`build_rules` makes the cap from the config; the scheduler takes it by default, or the rules it is given."""
    (cap,) = build_rules(SchedulerConfig(max_loras=2))
    assert isinstance(cap, AdapterCap) and cap.max_adapters == 2
    assert build_rules(SchedulerConfig()) == ()
    sched, _ = make(max_loras=3)
    assert [type(r) for r in sched.rules] == [AdapterCap]
    kv = BlockManager(64, BS)
    assert Scheduler(SchedulerConfig(max_model_len=64, max_loras=3), kv, rules=()).rules == ()
    with pytest.raises(ValueError, match="max_adapters"):
        AdapterCap(0)


def test_adapter_cap_fits_running_adapters_and_holds_only_adapter_requests_behind() -> None:
    """A running adapter always fits, a new one only under the cap; base requests always fit and never wait."""
    cap = AdapterCap(1)
    running = [lora_req("r", 7)]
    assert cap.fits(lora_req("same", 7), running) and not cap.fits(lora_req("other", 8), running)
    assert cap.fits(lora_req("base", None), running) and cap.fits(lora_req("first", 8), [])
    assert cap.holds_behind(lora_req("a", 7)) and not cap.holds_behind(lora_req("b", None))


class EvenOnly:
    """A custom admission rule: requests whose id ends in an odd digit never run beside another request."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def fits(self, request: Request, running: Sequence[Request]) -> bool:
        self.asked.append(request.request_id)
        return not running or int(request.request_id[-1]) % 2 == 0

    def holds_behind(self, request: Request) -> bool:
        return False


def test_a_custom_admission_rule_holds_requests_without_starving_the_rest() -> None:
    """The scheduler asks every rule at admission: a held request keeps its place while the others pass."""
    rule = EvenOnly()
    rules: list[AdmissionRule] = [rule]
    cfg = SchedulerConfig(max_model_len=64, watermark=0.0)
    sched = Scheduler(cfg, BlockManager(256, BS), rules=rules)
    model = TokenCacheModel(256, BS)
    for rid in ("r0", "r1", "r2"):
        sched.add_request(lora_req(rid, None, max_tokens=2))
    first = step(sched, model)
    assert [c.request_id for c in first.scheduled] == ["r0", "r2"]  # r1 held, r2 passed it
    assert "r1" in rule.asked and [r.request_id for r in sched.waiting] == ["r1"]
    for _ in range(10):
        if not sched.has_unfinished_requests():
            break
        step(sched, model)
    assert not sched.has_unfinished_requests()  # r1 ran once the batch drained
