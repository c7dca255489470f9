"""The children index behind `abort_request`: a group's sequences are found by its id, never by a scan, and the
index follows every fork, finish and abort (check_invariants recomputes it from the request map)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pagoda.blockalloc import BlockManager
from pagoda.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from pagoda.scheduler.testing import SimSamplingParams

BS = 4


class _NoScan(dict[str, Request]):
    """A request map that refuses iteration: lookups by id only."""

    def values(self) -> Any:
        """Refused."""
        raise AssertionError("the request map was scanned")

    def items(self) -> Any:
        """Refused."""
        raise AssertionError("the request map was scanned")

    def __iter__(self) -> Iterator[str]:
        """Refused."""
        raise AssertionError("the request map was scanned")


def make(num_blocks: int = 64) -> tuple[Scheduler, BlockManager]:
    """A scheduler over a real BlockManager."""
    kv = BlockManager(num_blocks, BS)
    return Scheduler(SchedulerConfig(max_model_len=64, watermark=0.0), kv), kv


def test_index_follows_forks_finishes_and_aborts() -> None:
    """n = 3 forks two children into the index; a finished child leaves it; an abort of the group takes the
    parent and the rest; an abort of one child id takes that child only."""
    sched, kv = make()
    sched.add_request(
        Request("a", list(range(6)), SimSamplingParams(max_tokens=8, n=3, stop_token_ids=(99,)))
    )
    sched.add_request(Request("b", list(range(5)), SimSamplingParams(max_tokens=8, n=2)))
    out = sched.schedule()
    sched.update_from_output(out, {"a": [1], "a:1": [2], "a:2": [3], "b": [1], "b:1": [2]})
    sched.check_invariants()
    assert sched._children == {"a": {"a:1": None, "a:2": None}, "b": {"b:1": None}}
    # A child that finishes (its stop token) leaves the index.
    out = sched.schedule()
    finished = sched.update_from_output(out, {"a": [4], "a:1": [99], "a:2": [5], "b": [6], "b:1": [7]})
    assert [r.request_id for r in finished] == ["a:1"]
    sched.check_invariants()
    assert sched._children["a"] == {"a:2": None}
    # One child id aborts that child alone.
    assert [r.request_id for r in sched.abort_request("b:1")] == ["b:1"]
    assert "b" not in sched._children and sched.get_request("b") is not None
    sched.check_invariants()
    # The group id aborts the parent and its remaining children, in fork order.
    aborted = sched.abort_request("a")
    assert [r.request_id for r in aborted] == ["a", "a:2"]
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in aborted)
    assert "a" not in sched._children
    sched.check_invariants()
    assert sched.abort_request("a") == []
    sched.abort_request("b")
    assert not sched.has_unfinished_requests() and kv.stats().num_used_blocks == 0 and sched._children == {}


def test_beam_forks_outlive_their_root_and_abort_with_the_group() -> None:
    """Held sequences forked by fork_sequence join their group's index, even after the group's first sequence
    is pruned; aborting the group id then takes every beam left."""
    sched, kv = make()
    sched.add_request(Request("g", list(range(9)), SimSamplingParams(max_tokens=8, n=2)))
    out = sched.schedule()
    sched.update_from_output(out, {}, held_ids=("g", "g:1"))
    sched.fork_sequence("g:1", "g:x")  # a fork of a child belongs to the group, not to the child
    sched.finish_sequence("g")
    sched.check_invariants()
    assert sched._children == {"g": {"g:1": None, "g:x": None}}
    assert [r.request_id for r in sched.abort_request("g")] == ["g:1", "g:x"]
    sched.check_invariants()
    assert not sched.has_unfinished_requests() and kv.stats().num_used_blocks == 0


def test_abort_looks_requests_up_by_id_without_a_scan() -> None:
    """With many requests in the scheduler, an abort touches only its own group's entries of the request map."""
    sched, _ = make(num_blocks=512)
    for i in range(50):
        sched.add_request(Request(f"r{i}", list(range(4)), SimSamplingParams(max_tokens=4, n=2)))
    out = sched.schedule()
    sched.update_from_output(out, {sid: [1] for chunk in out.scheduled for sid in chunk.sample_ids})
    sched._requests = _NoScan(sched._requests)
    aborted = sched.abort_request("r7")
    assert [r.request_id for r in aborted] == ["r7", "r7:1"]
    assert sched.abort_request("missing") == []
    sched._requests = dict(sched._requests)
    sched.check_invariants()
    assert sched.get_num_unfinished_requests() == 98
