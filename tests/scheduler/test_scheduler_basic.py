"""Scheduler unit tests with the real BlockManager: admission, chunking, budget, stop rules, n > 1, prefix hits."""

from __future__ import annotations

from typing import Any

import pytest
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import (
    Request,
    RequestRejectedError,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    sample_id,
)
from pagoda.scheduler.testing import SimSamplingParams, TokenCacheModel, reference_output, run_to_completion

BS = 4


def make(num_blocks: int = 64, *, num_host_blocks: int = 0, **config: Any) -> tuple[Scheduler, BlockManager]:
    """A scheduler over a real BlockManager of `num_blocks` blocks of BS slots."""
    cfg = SchedulerConfig(**{"max_model_len": 64, "watermark": 0.0, **config})
    kv = BlockManager(
        num_blocks, BS, num_host_blocks=num_host_blocks, enable_prefix_caching=cfg.enable_prefix_caching
    )
    return Scheduler(cfg, kv), kv


def req(rid: str, prompt: list[int] | int, **params: Any) -> Request:
    """A request with `prompt` (or that many tokens, distinct per id) and SimSamplingParams(**params)."""
    base = 1000 * (sum(map(ord, rid)) % 1000)  # distinct prompts do not hit each other's prefix cache
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else prompt
    return Request(rid, tokens, SimSamplingParams(**params))


def step(sched: Scheduler, model: TokenCacheModel) -> tuple[SchedulerOutput, list[Request]]:
    """One schedule + execute + update."""
    out = sched.schedule()
    return out, sched.update_from_output(out, model.execute(out))


def chunks(out: SchedulerOutput) -> list[tuple[str, int, int, int]]:
    """(id, start, num_tokens, num_samples) of every scheduled chunk."""
    return [(c.request_id, c.start, c.num_tokens, c.num_samples) for c in out.scheduled]


def test_config_validation() -> None:
    """Impossible configurations are refused."""
    for bad in (
        {"max_num_seqs": 0},
        {"long_prefill_token_threshold": 0},
        {"preemption_mode": "drop"},
        {"watermark": 1.0},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 8, "max_model_len": 16},
        {"max_num_partial_prefills": 0},
        {"max_batch_prefill_tokens": 0},
        {"enable_chunked_prefill": False, "max_batch_prefill_tokens": 8, "max_model_len": 16},
    ):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)


def test_add_request_rejects_what_can_never_run() -> None:
    """More blocks than the pool, n over max_num_seqs, malformed, taken ids: rejected at once."""
    sched, _ = make(num_blocks=4, max_model_len=32, max_num_seqs=2)
    cases = [
        req("long", 20, max_tokens=13),  # 33 > max_model_len, but refused for its 8 blocks > 4
        req("big", 10, max_tokens=8),  # 17 slots -> 5 blocks > 4
        req("wide", 2, n=3),
        req("empty", []),
        req("zero", 3, max_tokens=0),
    ]
    for request in cases:
        with pytest.raises(RequestRejectedError) as info:
            sched.add_request(request)
        assert request.request_id in str(info.value)
        assert isinstance(info.value, ValueError)
    sched.add_request(req("fits", 10, max_tokens=7))  # 16 slots = the whole pool: allowed
    sched.add_request(req("a", 2, n=2, max_tokens=4))
    for taken in ("fits", "a", "a:1"):
        with pytest.raises(RequestRejectedError):
            sched.add_request(req(taken, 2))
    assert sched.get_num_unfinished_requests() == 2


def test_rejections_name_the_field_at_fault() -> None:
    """The pool blames the prompt when it alone overflows, else max_tokens; then n and taken ids."""
    sched, _ = make(num_blocks=4, max_num_seqs=2)
    sched.add_request(req("a", 2, n=2, max_tokens=4))
    cases = [
        (req("p", 17, max_tokens=1), "prompt"),  # 17 prompt slots: 5 blocks > 4
        (req("m", 10, max_tokens=8), "max_tokens"),  # 3 prompt blocks, 5 with the outputs
        (req("w", 2, n=3, max_tokens=2), "n"),
        (req("a:1", 2), "request_id"),  # a sample id of "a"
        (req("e", []), None),  # malformed, no single field to blame
    ]
    for request, param in cases:
        with pytest.raises(RequestRejectedError) as info:
            sched.add_request(request)
        assert info.value.param == param
    assert sched.get_num_unfinished_requests() == 1


def test_max_model_len_is_the_embedding_engines_rule() -> None:
    """A request over max_model_len that fits the pool is accepted and length-capped at max_model_len."""
    sched, kv = make(max_model_len=16)
    model = TokenCacheModel(kv.num_blocks, BS)
    request = req("r", 12, max_tokens=10)  # 22 > 16 tokens, 6 of 64 blocks
    sched.add_request(request)
    run_to_completion(sched, model)
    assert request.finish_reason == "length" and request.num_tokens == 16
    assert list(request.output_token_ids) == reference_output(
        request.prompt_token_ids, request.sampling_params, 16
    )


def test_sample_ids_are_named_in_one_place() -> None:
    """Sample 0 runs under the request's own id, sample i under "id:i"; forks use the same names."""
    assert sample_id("r", 0) == "r"
    assert [sample_id("r", i) for i in (1, 2)] == ["r:1", "r:2"]
    assert req("p", 3, n=3).child_ids() == (sample_id("p", 1), sample_id("p", 2))


def test_chunked_prefill_splits_a_long_prompt_to_the_budget() -> None:
    """A 20-token prompt under a budget of 8 runs as chunks 8, 8, 4; only the last samples; then decodes."""
    sched, kv = make(max_num_batched_tokens=8)
    model = TokenCacheModel(kv.num_blocks, BS)
    sched.add_request(req("a", 20, max_tokens=3))
    seen = [chunks(step(sched, model)[0]) for _ in range(4)]
    assert seen == [[("a", 0, 8, 0)], [("a", 8, 8, 0)], [("a", 16, 4, 1)], [("a", 20, 1, 1)]]


def test_long_prefill_threshold_caps_one_requests_share() -> None:
    """With a threshold of 5 and a budget of 8, two prompts share each step 5 + 3."""
    sched, kv = make(max_num_batched_tokens=8, long_prefill_token_threshold=5)
    model = TokenCacheModel(kv.num_blocks, BS)
    sched.add_request(req("a", 12))
    sched.add_request(req("b", 12))
    assert chunks(step(sched, model)[0]) == [("a", 0, 5, 0), ("b", 0, 3, 0)]
    assert chunks(step(sched, model)[0]) == [("a", 5, 5, 0), ("b", 3, 3, 0)]


def test_max_num_partial_prefills_caps_requests_mid_prefill() -> None:
    """With a cap of 1, b waits until a's prompt completes; its chunk then shares the step with a's decode."""
    sched, kv = make(max_num_batched_tokens=8, max_num_partial_prefills=1)
    model = TokenCacheModel(kv.num_blocks, BS)
    sched.add_request(req("a", 12, max_tokens=2))
    sched.add_request(req("b", 12, max_tokens=2))
    assert chunks(step(sched, model)[0]) == [("a", 0, 8, 0)]  # b would fit in the budget left, but waits
    assert chunks(step(sched, model)[0]) == [("a", 8, 4, 1)]  # a completes its prompt this step
    assert chunks(step(sched, model)[0]) == [("a", 12, 1, 1), ("b", 0, 7, 0)]


def test_max_batch_prefill_tokens_caps_prefills_but_not_decodes() -> None:
    """TGI's prefill budget: 6 prefill tokens a step in a budget of 16; decodes come on top of it."""
    sched, kv = make(max_num_batched_tokens=16, max_batch_prefill_tokens=6)
    model = TokenCacheModel(kv.num_blocks, BS)
    sched.add_request(req("a", 3, max_tokens=4))
    sched.add_request(req("b", 10, max_tokens=2))
    assert chunks(step(sched, model)[0]) == [("a", 0, 3, 1), ("b", 0, 3, 0)]
    sched.add_request(req("c", 4, max_tokens=2))
    assert chunks(step(sched, model)[0]) == [("a", 3, 1, 1), ("b", 3, 6, 0)]
    assert chunks(step(sched, model)[0]) == [("a", 4, 1, 1), ("b", 9, 1, 1), ("c", 0, 4, 1)]


def test_decodes_come_before_prefill_chunks_and_admissions() -> None:
    """Order in a step: running decodes, then continuing prefills, then newly admitted requests."""
    sched, kv = make(max_num_batched_tokens=10)
    model = TokenCacheModel(kv.num_blocks, BS)
    sched.add_request(req("a", 3, max_tokens=8))
    sched.add_request(req("b", 12, max_tokens=8))
    assert chunks(step(sched, model)[0]) == [("a", 0, 3, 1), ("b", 0, 7, 0)]
    sched.add_request(req("c", 4, max_tokens=8))
    assert chunks(step(sched, model)[0]) == [("a", 3, 1, 1), ("b", 7, 5, 1), ("c", 0, 4, 1)]


def test_budget_and_max_num_seqs_are_never_exceeded() -> None:
    """Many requests, small limits: every step fits the budget and the seat limit; all finish with all tokens."""
    sched, kv = make(max_num_batched_tokens=16, max_num_seqs=3)
    model = TokenCacheModel(kv.num_blocks, BS)
    requests = [req(f"r{i}", 3 + 2 * i, max_tokens=2 + i) for i in range(8)]
    for r in requests:
        sched.add_request(r)

    def check(out: SchedulerOutput) -> None:
        assert out.num_batched_tokens == sum(c.num_tokens for c in out.scheduled) <= 16
        assert len(out.scheduled) <= 3 and len(sched.running) <= 3
        sched.check_invariants()
        kv.check_invariants()

    result = run_to_completion(sched, model, after_schedule=check)
    assert {r.request_id for r in result.finished} == {r.request_id for r in requests}
    for r in requests:
        assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED and r.finish_reason == "length"
        assert list(r.output_token_ids) == reference_output(r.prompt_token_ids, r.sampling_params, 64)
        assert r.num_output_tokens == r.sampling_params.max_tokens
    assert kv.num_free_blocks() == kv.num_blocks and kv.stats().num_used_blocks == 0


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits() -> None:
    """Chunking off: a prompt that does not fit the remaining budget waits for the next step."""
    sched, kv = make(enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=32)
    model = TokenCacheModel(kv.num_blocks, BS)
    sched.add_request(req("a", 20, max_tokens=4))
    sched.add_request(req("b", 20, max_tokens=4))
    assert chunks(step(sched, model)[0]) == [("a", 0, 20, 1)]
    assert chunks(step(sched, model)[0]) == [("a", 20, 1, 1), ("b", 0, 20, 1)]


def test_stop_token_min_tokens_and_stop_strings() -> None:
    """A stop token stops (and beats the length cap), not before min_tokens; the engine's stop ids stop too."""
    prompt = [5, 9, 2, 7]
    free_run = reference_output(prompt, SimSamplingParams(max_tokens=12), 64)
    stop = free_run[2]
    assert stop not in free_run[:2]
    requests = {
        rid: Request(rid, prompt, params)
        for rid, params in {
            "stop": SimSamplingParams(max_tokens=12, stop_token_ids=(stop,)),
            "both": SimSamplingParams(max_tokens=3, stop_token_ids=(stop,)),
            "min": SimSamplingParams(max_tokens=12, min_tokens=4, stop_token_ids=(stop,)),
            "engine": SimSamplingParams(max_tokens=12),
        }.items()
    }
    sched, kv = make()
    model = TokenCacheModel(kv.num_blocks, BS)
    for r in requests.values():
        sched.add_request(r)
    out = sched.schedule()
    finished = sched.update_from_output(out, model.execute(out), stop_request_ids=("engine",))
    assert finished == [requests["engine"]]
    assert (
        requests["engine"].status is RequestStatus.FINISHED_STOPPED
        and requests["engine"].num_output_tokens == 1
    )
    assert not kv.has_seq("engine")
    run_to_completion(sched, model)
    for rid in ("stop", "both"):
        assert list(requests[rid].output_token_ids) == free_run[:3]
        assert requests[rid].status is RequestStatus.FINISHED_STOPPED and requests[rid].stop_token_id == stop
    late = requests["min"]
    assert list(late.output_token_ids) == reference_output(prompt, late.sampling_params, 64)
    assert late.num_output_tokens > 3 and late.output_token_ids[2] == stop


def test_finish_reasons_are_reported() -> None:
    """Statuses map to the OpenAI finish reasons and order like vLLM's."""
    assert RequestStatus.finish_reason(RequestStatus.FINISHED_STOPPED) == "stop"
    assert RequestStatus.finish_reason(RequestStatus.FINISHED_LENGTH_CAPPED) == "length"
    assert RequestStatus.finish_reason(RequestStatus.FINISHED_ABORTED) == "abort"
    assert RequestStatus.finish_reason(RequestStatus.RUNNING) is None
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    assert RequestStatus.is_finished(RequestStatus.FINISHED_ABORTED)


def test_prefix_cache_hits_skip_computed_tokens_and_spend_no_budget() -> None:
    """A prompt sharing cached blocks starts at the cached length; only the rest is scheduled and budgeted."""
    sched, kv = make(max_num_batched_tokens=64)
    model = TokenCacheModel(kv.num_blocks, BS)
    shared = list(range(100, 113))  # 13 tokens: 3 full blocks
    first = Request("first", shared, SimSamplingParams(max_tokens=2))
    sched.add_request(first)
    run_to_completion(sched, model)
    same = Request("same", shared, SimSamplingParams(max_tokens=4))
    longer = Request("longer", [*shared[:12], 7, 8, 9, 10, 11], SimSamplingParams(max_tokens=4))
    sched.add_request(same)
    sched.add_request(longer)
    out, _ = step(sched, model)
    assert chunks(out) == [("same", 12, 1, 1), ("longer", 12, 5, 1)]
    assert out.num_batched_tokens == 6
    assert kv.block_table("same")[:3] == kv.block_table("longer")[:3]
    stats = sched.stats()
    assert stats.prefix_cache_hits == 24 and stats.prefix_cache_hit_rate > 0
    run_to_completion(sched, model)
    for r in (first, same, longer):
        assert list(r.output_token_ids) == reference_output(r.prompt_token_ids, r.sampling_params, 64)


def test_prefix_caching_off_computes_everything() -> None:
    """With enable_prefix_caching=False the same prompt is computed from position 0."""
    sched, kv = make(enable_prefix_caching=False)
    model = TokenCacheModel(kv.num_blocks, BS)
    sched.add_request(req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=1))
    run_to_completion(sched, model)
    sched.add_request(req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=1))
    assert chunks(step(sched, model)[0]) == [("b", 0, 9, 1)]


def test_parallel_sampling_forks_children_sharing_the_prompt_blocks() -> None:
    """n = 3: the prompt is computed once, then 3 sequences share its blocks and copy the partial one on write."""
    sched, kv = make(max_num_seqs=4)
    model = TokenCacheModel(kv.num_blocks, BS)
    params = SimSamplingParams(max_tokens=5, n=3)
    parent = Request("p", list(range(30, 40)), params)  # 10 tokens: 2 full blocks + 2 tokens
    sched.add_request(parent)
    sched.add_request(req("other", 3, max_tokens=5))
    out, _ = step(sched, model)
    assert chunks(out) == [("p", 0, 10, 3), ("other", 0, 3, 1)]
    assert out.scheduled[0].sample_ids == ("p", "p:1", "p:2")
    assert sched.num_running_seqs == 4 and sched.get_num_unfinished_requests() == 4
    tables = [kv.block_table(i) for i in ("p", "p:1", "p:2")]
    assert tables[0] == tables[1] == tables[2]  # everything shared until someone writes
    children = [sched.get_request(f"p:{i}") for i in (1, 2)]
    assert all(c is not None and c.parent_id == "p" and c.group_id == "p" for c in children)
    out, _ = step(sched, model)
    assert len(out.blocks_to_copy) == 2  # two writers copy the shared partial block, the last writes in place
    tables = [kv.block_table(i) for i in ("p", "p:1", "p:2")]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    result = run_to_completion(sched, model)
    samples = {r.request_id: r for r in result.finished if r.group_id == "p"}
    samples["p"] = parent
    for index, rid in enumerate(("p", "p:1", "p:2")):
        expected = reference_output(parent.prompt_token_ids, params, 64, sample_index=index)
        assert list(samples[rid].output_token_ids) == expected
        assert samples[rid].sample_index == index
    assert len({tuple(s.output_token_ids) for s in samples.values()}) == 3
    assert kv.num_free_blocks() == kv.num_blocks


def test_parallel_sampling_takes_its_seats_at_admission() -> None:
    """A waiting n = 3 request is only admitted when 3 seats are free."""
    sched, kv = make(max_num_seqs=3)
    model = TokenCacheModel(kv.num_blocks, BS)
    sched.add_request(req("a", 3, max_tokens=3))
    sched.add_request(req("b", 3, max_tokens=2, n=3))
    out, _ = step(sched, model)
    assert chunks(out) == [("a", 0, 3, 1)]
    while sched.get_request("a") is not None:
        out, _ = step(sched, model)
        assert "b" not in [c.request_id for c in out.scheduled]
    assert chunks(step(sched, model)[0]) == [("b", 0, 3, 3)]
