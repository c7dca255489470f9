"""The prefill peak of sliding-window groups (issue 39, item 6): a window group holds chunk + window while a chunk
runs and the window alone after it. The scheduler gives the passed blocks back right after each prefill chunk,
shortens a prefill chunk to the free blocks instead of preempting anyone, and admits a request when its prompt's
steady footprint fits. Every sample still gets its reference tokens (the token-cache model reads every key back)."""

from __future__ import annotations

from pagoda.blockalloc import FULL_ATTENTION, BlockManager, KVCacheGroupSpec
from pagoda.scheduler import Request, Scheduler, SchedulerConfig, SchedulerOutput
from pagoda.scheduler.testing import SimSamplingParams, TokenCacheModel, reference_output, run_to_completion

BS = 4
W = 4
MAX_LEN = 64


def windowed(num_blocks: int) -> tuple[BlockManager, TokenCacheModel]:
    """A full-attention group and a window of W keys over one pool, and the model that checks what is read."""
    kv = BlockManager(num_blocks, BS, groups=(FULL_ATTENTION, KVCacheGroupSpec(sliding_window=W)))
    return kv, TokenCacheModel(num_blocks, BS, 0, sliding_windows=(None, W))


def scheduler(kv: BlockManager, budget: int) -> Scheduler:
    """No watermark, so that the pool sizes below are exact."""
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=MAX_LEN, watermark=0.0
    )
    return Scheduler(config, kv)


def add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int, arrival: float) -> Request:
    """A request with distinct prompt tokens."""
    prompt = tuple(range(100 * (ord(rid[0]) - 96), 100 * (ord(rid[0]) - 96) + prompt_len))
    request = Request(rid, prompt, SimSamplingParams(max_tokens=max_tokens), arrival_time=arrival)
    sched.add_request(request)
    return request


def check_reference(requests: list[Request], finished: list[Request]) -> None:
    """Every request's tokens are the reference ones."""
    by_id = {r.request_id: r for r in finished}
    for request in requests:
        expected = reference_output(request.prompt_token_ids, request.sampling_params, MAX_LEN)
        assert list(by_id[request.request_id].output_token_ids) == expected


def test_a_prefill_chunk_shrinks_to_the_free_blocks_and_nobody_is_preempted() -> None:
    """b's whole prompt (40 tokens: 10 + 10 blocks) does not fit beside a's decode; its steady footprint (10 + 2)
    does. b is admitted with the longest chunk that fits, its window blocks come back after every chunk, and no
    step preempts anyone."""
    kv, model = windowed(20)  # 19 usable beside the null block
    sched = scheduler(kv, budget=64)
    requests = [add(sched, "a", 8, 20, 0.0), add(sched, "b", 40, 4, 1.0)]

    def after_schedule(out: SchedulerOutput) -> None:
        sched.check_invariants()
        kv.check_invariants()

    result = run_to_completion(sched, model, after_schedule=after_schedule, max_steps=200)
    b_chunks = [c for out in result.outputs for c in out.scheduled if c.request_id == "b"]
    assert b_chunks[0].start == 0 and b_chunks[0].num_tokens < 40  # shortened, not refused
    assert sum(c.num_tokens for c in b_chunks if c.start < 40) == 40
    assert not any(out.preempted_request_ids for out in result.outputs)
    check_reference(requests, result.finished)
    assert kv.num_free_blocks() == kv.num_blocks


def test_window_blocks_come_back_right_after_each_prefill_chunk() -> None:
    """Between steps, no running sequence's window group holds more than the blocks its next query can see."""
    kv, model = windowed(64)
    sched = scheduler(kv, budget=16)
    requests = [add(sched, "a", 37, 3, 0.0), add(sched, "b", 21, 5, 1.0)]
    most: list[int] = []
    finished: list[Request] = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        finished += sched.update_from_output(out, model.execute(out))
        for request in sched.running:
            local = kv.block_tables(request.request_id)[1]
            most.append(sum(1 for b in local if b != 0))
            kv.check_invariants()
    # A query at p sees p - 3 .. p: at most 2 blocks of 4 hold those keys.
    assert most and max(most) <= -(-(W - 1 + 1) // BS) + 1
    check_reference(requests, finished)


def test_admission_waits_for_the_prompts_steady_footprint() -> None:
    """b's first chunk would fit beside a, but its prompt could never finish there: b waits until a is done
    instead of being admitted and preempted (the old churn); then it runs whole."""
    kv, model = windowed(16)  # 15 usable
    sched = scheduler(kv, budget=64)
    requests = [add(sched, "a", 28, 8, 0.0), add(sched, "b", 28, 2, 1.0)]
    # a holds 7 + 2 blocks after its prefill; b's steady footprint is 7 + 2 = 9 > 6 free.
    admitted_while_a_ran = False

    def after_schedule(out: SchedulerOutput) -> None:
        nonlocal admitted_while_a_ran
        ids = {c.request_id for c in out.scheduled}
        admitted_while_a_ran |= "a" in ids and "b" in ids

    result = run_to_completion(sched, model, after_schedule=after_schedule, max_steps=200)
    assert not admitted_while_a_ran
    assert not any(out.preempted_request_ids for out in result.outputs)
    check_reference(requests, result.finished)


def test_a_full_attention_prefill_chunk_shrinks_too() -> None:
    """One full-attention group: b's second chunk (10 tokens, 3 blocks) meets 2 free blocks beside a's decode
    and takes those 8 tokens in that step, preempting nobody; tokens unchanged (a's later growth may still
    preempt: that is the pool's size, not the chunk)."""
    kv = BlockManager(9, BS)
    sched = scheduler(kv, budget=24)
    requests = [add(sched, "a", 4, 10, 0.0), add(sched, "b", 30, 2, 1.0)]
    result = run_to_completion(sched, TokenCacheModel(9, BS, 0), max_steps=200)
    second = result.outputs[1]
    assert [(c.request_id, c.start, c.num_tokens) for c in second.scheduled] == [("a", 4, 1), ("b", 20, 8)]
    assert not second.preempted_request_ids
    check_reference(requests, result.finished)
