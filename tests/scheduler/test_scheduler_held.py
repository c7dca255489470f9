"""Held sequences (the mechanism under the engine's beam search): parked, forked onto shared blocks, pruned."""

from __future__ import annotations

from pagoda.blockalloc import BlockManager
from pagoda.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from pagoda.scheduler.testing import SimSamplingParams

BS = 4


def make(num_blocks: int = 32) -> tuple[Scheduler, BlockManager]:
    """A scheduler over a real BlockManager."""
    kv = BlockManager(num_blocks, BS)
    return Scheduler(SchedulerConfig(max_model_len=64, watermark=0.0), kv), kv


def test_held_sequences_park_fork_with_copy_on_write_and_free() -> None:
    """A held sample gets no token and is not scheduled; a fork shares every block and copies the last on write."""
    sched, kv = make()
    sched.add_request(Request("a", list(range(10)), SimSamplingParams(max_tokens=8, n=2)))
    out = sched.schedule()
    assert out.scheduled[0].sample_ids == ("a", "a:1")
    assert sched.update_from_output(out, {}, held_ids=("a", "a:1")) == []
    # Both samples are parked: every token computed, nothing to schedule.
    assert sched.schedule().scheduled == ()
    used = kv.stats().num_used_blocks
    assert used == 3  # 10 prompt tokens in 4-token blocks, shared by the fork at the prompt's end
    # Prune "a:1", fork "a" into "a:x", give each its token: the fork shares all three blocks.
    sched.finish_sequence("a:1")
    sched.fork_sequence("a", "a:x")
    assert kv.block_table("a:x") == kv.block_table("a") and kv.stats().num_used_blocks == 3
    sched.append_token("a", 7)
    sched.append_token("a:x", 8)
    assert list(sched.get_request("a:x").all_token_ids) == [*range(10), 8]  # type: ignore[union-attr]
    out = sched.schedule()
    assert [(c.request_id, c.token_ids) for c in out.scheduled] == [("a", (7,)), ("a:x", (8,))]
    # The shared, partially filled last block is copied once: the second writer owns it alone by then.
    assert len(out.blocks_to_copy) == 1 and kv.stats().num_used_blocks == 4
    assert kv.block_table("a")[:2] == kv.block_table("a:x")[:2]
    sched.update_from_output(out, {}, held_ids=("a", "a:x"))
    sched.check_invariants()
    kv.check_invariants()
    for seq_id in ("a", "a:x"):
        sched.finish_sequence(seq_id)
    assert not sched.has_unfinished_requests() and kv.stats().num_used_blocks == 0


def test_fork_of_a_preempted_sequence_waits_for_recompute() -> None:
    """A held parent preempted for a decode forks into a waiting child; both recompute their tokens."""
    sched, kv = make(num_blocks=3)
    sched.add_request(Request("b", list(range(100, 108)), SimSamplingParams(max_tokens=4), arrival_time=0.0))
    sched.add_request(Request("a", list(range(4)), SimSamplingParams(max_tokens=4), arrival_time=1.0))
    out = sched.schedule()
    sched.update_from_output(out, {"b": [1]}, held_ids=("a",))
    out = sched.schedule()  # b's decode needs the third block: held "a", the latest arrival, is preempted
    assert out.preempted_request_ids == ("a",) and not kv.has_seq("a")
    sched.update_from_output(out, {"b": [2]})
    sched.fork_sequence("a", "a:x")
    child = sched.get_request("a:x")
    assert child is not None and child.status is RequestStatus.PREEMPTED and not kv.has_seq("a:x")
    sched.append_token("a", 5)
    sched.append_token("a:x", 6)
    sched.check_invariants()
    sched.abort_request("b")
    last: dict[str, tuple[int, int]] = {}  # the (position, token) each sequence's last chunk ends on
    for _ in range(3):  # the two recomputes take one or two steps, as blocks allow
        out = sched.schedule()
        last.update((c.request_id, (c.seq_len, c.token_ids[-1])) for c in out.scheduled)
        sched.update_from_output(out, {}, held_ids=("a", "a:x"))
        sched.check_invariants()
    # The second one admitted shares the first's full prompt block through the prefix cache.
    assert last == {"a": (5, 5), "a:x": (5, 6)}
    assert kv.block_table("a")[0] == kv.block_table("a:x")[0]
