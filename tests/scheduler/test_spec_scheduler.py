"""Speculative decoding in the scheduler: drafts inside the token budget, rollback by num_rejected, exact KV.

The fake model (`TokenCacheModel`) verifies draft chunks greedily from the tokens it reads back through the
block tables, so a wrong slot, a stale block or a bad rollback shows up as a token that differs from
`reference_output`.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import (
    ContiguousKVManager,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    TrimmableKVBlockManager,
    sample_id,
)
from pagoda.scheduler.testing import SimSamplingParams, TokenCacheModel, reference_output

BS = 4


def make(
    num_blocks: int = 64, *, num_host_blocks: int = 0, **config: Any
) -> tuple[Scheduler, BlockManager, TokenCacheModel]:
    """A scheduler over a real BlockManager, and the fake model over the same geometry."""
    cfg = SchedulerConfig(**{"max_model_len": 64, "watermark": 0.0, **config})
    kv = BlockManager(
        num_blocks, BS, num_host_blocks=num_host_blocks, enable_prefix_caching=cfg.enable_prefix_caching
    )
    return Scheduler(cfg, kv), kv, TokenCacheModel(num_blocks, BS, num_host_blocks)


def req(rid: str, prompt: list[int], **params: Any) -> Request:
    """A request with SimSamplingParams(**params)."""
    return Request(rid, prompt, SimSamplingParams(**params))


class Drafter:
    """Proposes k drafts per running decode: the true continuation with each token wrong at `error_rate`."""

    def __init__(self, k: int, error_rate: float, seed: int = 0) -> None:
        self.k = k
        self.error_rate = error_rate
        self.rng = random.Random(seed)
        self.proposed = 0

    def propose(self, scheduler: Scheduler, max_model_len: int) -> None:
        """Set drafts on every running request whose next chunk is a decode."""
        for request in scheduler.running:
            if request.num_tokens - request.num_computed_tokens != 1:
                continue
            # The oracle continuation of this sequence so far (salt 0: decodes after the first token).
            context = list(request.all_token_ids)
            truth = reference_output(
                context, SimSamplingParams(max_tokens=self.k), max_model_len=max_model_len + self.k + 2
            )
            drafts = [t if self.rng.random() >= self.error_rate else (t + 1) % 64 for t in truth[: self.k]]
            scheduler.set_draft_token_ids(request.request_id, drafts)
            self.proposed += len(drafts)


def run(
    sched: Scheduler,
    kv: BlockManager,
    model: TokenCacheModel,
    drafter: Drafter,
    max_steps: int = 5000,
) -> tuple[dict[str, list[int]], list[SchedulerOutput]]:
    """Step to completion with drafts; outputs by sequence id, and every step's output."""
    outputs: dict[str, list[int]] = {}
    steps: list[SchedulerOutput] = []
    max_model_len = sched.max_model_len
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs, steps
        out = sched.schedule()
        steps.append(out)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert sum(c.num_tokens for c in out.scheduled) == out.num_batched_tokens
        sched.check_invariants()
        for finished in sched.update_from_output(out, model.execute(out)):
            outputs[finished.request_id] = list(finished.output_token_ids)
        sched.check_invariants()
        kv.check_invariants()
        for request in sched.running:  # drafts rolled back: only real tokens hold slots
            assert kv.num_tokens(request.request_id) == request.num_computed_tokens <= request.num_tokens
        drafter.propose(sched, max_model_len)
    raise AssertionError("not done")


def prompts(num: int, seed: int, length: tuple[int, int] = (3, 14)) -> list[list[int]]:
    """Random prompts over the fake vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(64) for _ in range(rng.randint(*length))] for _ in range(num)]


@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0])
@pytest.mark.parametrize(
    "config",
    [
        {},
        {"max_num_batched_tokens": 7, "long_prefill_token_threshold": 5},  # chunked prefill, tight budget
        {"enable_prefix_caching": False},
    ],
)
def test_drafted_output_equals_reference(error_rate: float, config: dict[str, Any]) -> None:
    """Whatever the drafts' quality, every output equals the non-speculative reference."""
    sched, kv, model = make(**config)
    params: list[dict[str, Any]] = [
        {"max_tokens": 9},
        {"max_tokens": 1},
        {"max_tokens": 13, "stop_token_ids": (5, 17)},
    ]
    requests = []
    for i, prompt in enumerate(prompts(12, seed=7)):
        p = params[i % 3]
        sched.add_request(req(f"r{i}", prompt, **p))
        requests.append((f"r{i}", prompt, SimSamplingParams(**p)))
    drafter = Drafter(k=4, error_rate=error_rate, seed=1)
    outputs, steps = run(sched, kv, model, drafter)
    for rid, prompt, sp in requests:
        assert outputs[rid] == reference_output(prompt, sp, 64), rid
    assert kv.num_free_blocks() == kv.num_blocks
    drafted = [c for out in steps for c in out.scheduled if c.spec_token_ids]
    assert drafted, "no draft was ever scheduled"
    for out in steps:
        assert dict(out.scheduled_spec_decode_tokens) == {
            c.request_id: c.spec_token_ids for c in out.scheduled if c.spec_token_ids
        }
    for c in drafted:
        assert c.num_tokens == 1 + len(c.spec_token_ids) == len(c.slots)
        assert c.token_ids[1:] == c.spec_token_ids


def test_accepted_drafts_cut_the_steps() -> None:
    """Perfect drafts: a 16-token output takes 1 + ceil(15 / 5) steps with k = 4 (each step adds 1 + k)."""
    sched, kv, model = make()
    prompt = [3, 1, 4, 1, 5]
    sched.add_request(req("a", prompt, max_tokens=16))
    outputs, steps = run(sched, kv, model, Drafter(k=4, error_rate=0.0))
    assert outputs["a"] == reference_output(prompt, SimSamplingParams(max_tokens=16), 64)
    assert len(steps) == 1 + 3


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_drafts_with_preemption(mode: str) -> None:
    """Few blocks: requests are preempted (recompute or swap) between drafted steps; output unchanged."""
    sched, kv, model = make(14, num_host_blocks=32, preemption_mode=mode)
    requests = []
    for i, prompt in enumerate(prompts(8, seed=3, length=(5, 12))):
        sched.add_request(req(f"r{i}", prompt, max_tokens=14))
        requests.append((f"r{i}", prompt))
    outputs, steps = run(sched, kv, model, Drafter(k=3, error_rate=0.4, seed=2))
    assert sched.stats().num_preemptions > 0
    if mode == "swap":
        assert any(out.blocks_to_swap_out for out in steps)
    for rid, prompt in requests:
        assert outputs[rid] == reference_output(prompt, SimSamplingParams(max_tokens=14), 64), rid
    assert kv.num_free_blocks() == kv.num_blocks
    assert kv.num_free_host_blocks() == kv.num_host_blocks


def test_drafts_with_parallel_samples() -> None:
    """n = 2: the prompt step forks (no drafts on it), then each sample drafts on its own."""
    sched, kv, model = make()
    prompt = [9, 8, 7, 6, 5, 4]
    sched.add_request(req("p", prompt, max_tokens=10, n=2))
    outputs, steps = run(sched, kv, model, Drafter(k=3, error_rate=0.3, seed=5))
    sp = SimSamplingParams(max_tokens=10, n=2)
    for index in range(2):
        assert outputs[sample_id("p", index)] == reference_output(prompt, sp, 64, index)
    assert any(c.spec_token_ids and c.request_id == sample_id("p", 1) for out in steps for c in out.scheduled)
    assert kv.num_free_blocks() == kv.num_blocks


def test_drafts_capped_by_max_tokens_budget_and_model_len() -> None:
    """A decode's drafts never let the step pass max_tokens or max_model_len, nor the token budget."""
    sched, _kv, model = make(max_num_batched_tokens=8, max_model_len=12)
    sched.add_request(req("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=4))
    out = sched.schedule()
    sched.update_from_output(out, model.execute(out))  # the prompt: 1 output
    sched.set_draft_token_ids("a", [1, 2, 3, 4, 5, 6])
    out = sched.schedule()
    (chunk,) = out.scheduled
    assert chunk.spec_token_ids == (1, 2)  # 1 output + 1 + 2 = max_tokens
    sched.update_from_output(out, {"a": [next(iter(model.execute(out)["a"]))]})
    sched.check_invariants()
    sched.add_request(req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], max_tokens=2))
    sched.add_request(req("c", [11, 12], max_tokens=20))
    while sched.get_request("b") is None or sched.get_request("b").num_output_tokens == 0:  # type: ignore[union-attr]
        out = sched.schedule()
        sched.update_from_output(out, model.execute(out))
    sched.set_draft_token_ids("b", [1, 2, 3])
    sched.set_draft_token_ids("c", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    out = sched.schedule()
    by_id = {c.request_id: c for c in out.scheduled}
    assert by_id["b"].spec_token_ids == ()  # max_tokens - 1 output - 1 leaves no draft
    assert sum(c.num_tokens for c in out.scheduled) <= 8
    assert "c" in by_id and len(by_id["c"].spec_token_ids) <= 8 - 1


def test_drafts_never_preempt() -> None:
    """When the drafts' slots do not fit, the decode runs without them and nobody is preempted."""
    sched, kv, model = make(3)
    sched.add_request(req("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=6))
    sched.add_request(req("b", [8, 9, 10], max_tokens=2))
    out = sched.schedule()
    sched.update_from_output(out, model.execute(out))
    assert kv.num_free_blocks() == 0  # a holds 2 blocks (8 slots incl. its next token), b 1
    sched.set_draft_token_ids("a", [1, 2, 3])
    out = sched.schedule()
    assert not out.preempted_request_ids
    assert all(not c.spec_token_ids for c in out.scheduled)


def test_rejection_storm_returns_every_block() -> None:
    """Every draft wrong, long drafts across block boundaries: the pool's counts come back exactly."""
    sched, kv, model = make(40, num_host_blocks=8, preemption_mode="swap")
    for i, prompt in enumerate(prompts(10, seed=11)):
        sched.add_request(req(f"r{i}", prompt, max_tokens=20))
    drafter = Drafter(k=7, error_rate=1.0, seed=3)
    outputs, _steps = run(sched, kv, model, drafter)
    assert drafter.proposed > 100
    assert len(outputs) == 10
    assert kv.num_free_blocks() == kv.num_blocks
    assert kv.num_free_host_blocks() == kv.num_host_blocks
    assert kv.stats().num_used_blocks == 0
    kv.check_invariants()
    sched.check_invariants()


def test_prefix_cache_holds_only_accepted_tokens() -> None:
    """Rejected drafts that filled whole blocks are never prefix-cache hits for another request."""
    sched, kv, model = make()
    prompt = [1, 2, 3, 4, 5, 6, 7]
    sched.add_request(req("a", prompt, max_tokens=30))
    out = sched.schedule()
    sched.update_from_output(out, model.execute(out))
    a = sched.get_request("a")
    assert a is not None
    truth = reference_output(list(a.all_token_ids), SimSamplingParams(max_tokens=9), 99)
    wrong = [(t + 1) % 64 for t in truth]
    sched.set_draft_token_ids("a", wrong)  # 9 drafts: slots 8..16 over blocks 2..4
    out = sched.schedule()
    (chunk,) = out.scheduled
    assert len(chunk.spec_token_ids) == 9
    sched.update_from_output(out, model.execute(out))
    assert a.num_computed_tokens == 8 and kv.num_tokens("a") == 8
    committed = list(a.all_token_ids)
    # Drafted tokens as the prompt of another request: only the committed full blocks hit.
    assert kv.get_num_cached_tokens([*committed[:8], *wrong]) == 8
    sched.check_invariants()
    kv.check_invariants()


def test_bad_accepted_tokens_are_refused() -> None:
    """An update whose tokens are not accepted drafts plus one is a ValueError naming the sample."""
    sched, _kv, model = make()
    sched.add_request(req("a", [1, 2, 3], max_tokens=10))
    out = sched.schedule()
    sched.update_from_output(out, model.execute(out))
    sched.set_draft_token_ids("a", [4, 5])
    out = sched.schedule()
    with pytest.raises(ValueError, match="'a'"):
        sched.update_from_output(out, {"a": [9, 9]})  # 9 is not the first draft
    with pytest.raises(ValueError, match="'a'"):
        sched.update_from_output(out, {"a": [4, 5, 6, 7]})  # more than 1 + k


def test_allocator_without_trim_never_drafts() -> None:
    """Another allocator (no `trim`) embeds the scheduler unchanged: drafts are ignored."""
    kv_inner = BlockManager(64, BS)
    kv = ContiguousKVManager(kv_inner, 64)
    sched = Scheduler(SchedulerConfig(max_model_len=64), kv)
    assert not sched.supports_drafts
    model = TokenCacheModel(64, BS)
    prompt = [1, 2, 3]
    sched.add_request(req("a", prompt, max_tokens=6))
    outputs: dict[str, list[int]] = {}
    while sched.has_unfinished_requests():
        sched.set_draft_token_ids("a", [1, 2, 3])
        out = sched.schedule()
        assert not out.scheduled_spec_decode_tokens
        for r in sched.update_from_output(out, model.execute(out)):
            outputs[r.request_id] = list(r.output_token_ids)
    assert outputs["a"] == reference_output(prompt, SimSamplingParams(max_tokens=6), 64)


def test_block_manager_is_a_trimmable_allocator() -> None:
    """mypy proves the structural conformance; the scheduler sees `trim`."""
    kv: TrimmableKVBlockManager = BlockManager(8, BS)
    assert Scheduler(SchedulerConfig(max_model_len=32), kv).supports_drafts
