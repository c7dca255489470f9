"""Scheduler.queue_view: the three queues with progress, last chunk and priority, in queue order."""

from __future__ import annotations

from pagoda.blockalloc import BlockManager
from pagoda.scheduler import Request, Scheduler, SchedulerConfig
from pagoda.scheduler.testing.sim import SimSamplingParams as Params


def test_queue_view_shows_progress_chunks_and_priority() -> None:
    config = SchedulerConfig(max_num_seqs=1, max_model_len=64, max_num_batched_tokens=8)
    sched = Scheduler(config, BlockManager(num_blocks=16, block_size=4))
    sched.add_request(Request("a", list(range(20)), Params(max_tokens=4, priority=3)))
    sched.add_request(Request("b", list(range(5)), Params(max_tokens=4)))
    out = sched.schedule()
    chunks = {c.request_id: c.num_tokens for c in out.scheduled}
    assert chunks == {"a": 8}  # chunked prefill: 8 of 20 prompt tokens this step
    # The scheduler counts the chunk computed once the step's output comes back.
    sched.update_from_output(out, {}, {}, ())
    view = sched.queue_view(chunks)
    (a,) = view.running
    assert (a.request_id, a.num_computed_tokens, a.num_tokens, a.num_prompt_tokens, a.chunk, a.priority) == (
        "a",
        8,
        20,
        20,
        8,
        3,
    )
    assert [e.request_id for e in view.waiting] == ["b"] and view.waiting[0].chunk == 0
    assert view.swapped == ()
    assert sched.queue_view().running[0].chunk == 0  # no chunks given: none shown
