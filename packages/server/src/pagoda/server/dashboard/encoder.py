"""Frame encoding: block states and ref counts run-length encoded, block tables as runs of consecutive ids.

States (the page's colours): FREE, CACHED (unreferenced but still a prefix-cache hit: evictable), OWNED (ref
count 1: one sequence), SHARED (ref count >= 2: a copy-on-write fork or a prefix hit) on the device tier, and
SWAPPED on the host tier (a preempted sequence's copy). With KV cache groups (sliding-window layers), RESERVED is
the null block (the stand-in for the blocks a window left behind) and each group gets a map of its own, where
OTHER marks the blocks another group holds (all groups draw from one pool: a free block is free for all).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from itertools import groupby, repeat
from typing import Any

from pagoda.blockalloc import BlockMapSnapshot
from pagoda.scheduler import QueueEntry, QueueView
from pagoda.server.dashboard.snapshot import ReplicaSnapshot

FREE, CACHED, OWNED, SHARED, SWAPPED, RESERVED, OTHER = 0, 1, 2, 3, 4, 5, 6
STATE_NAMES = ("free", "cached", "owned", "shared", "swapped")  # the counts of every map
GROUP_STATE_NAMES = ("free", "cached", "owned", "shared", "other")  # the counts of a group's map
# Device state by min(ref count, 2).
_BY_REF = bytes((FREE, OWNED, SHARED))


def run_length(values: Iterable[int]) -> list[int]:
    """[value, count, value, count, ...] for the runs of equal values."""
    out: list[int] = []
    for value, run in groupby(values):
        out += (value, sum(1 for _ in run))
    return out


def expand_runs(runs: Sequence[int]) -> list[int]:
    """The values back from `run_length`'s output (for tests and the page's logic)."""
    out: list[int] = []
    for i in range(0, len(runs), 2):
        out += [runs[i]] * runs[i + 1]
    return out


def id_runs(block_ids: Iterable[int]) -> list[int]:
    """[first_id, length, ...] for the runs of consecutive block ids of one table, in table order."""
    out: list[int] = []
    for block_id in block_ids:
        if out and out[-2] + out[-1] == block_id:
            out[-1] += 1
        else:
            out += (block_id, 1)
    return out


def device_states(blocks: BlockMapSnapshot, ref_counts: array[int] | None = None) -> bytearray:
    """[num_blocks] state of each device block (`ref_counts`: blocks.ref_counts(), if already computed)."""
    refs = blocks.ref_counts() if ref_counts is None else ref_counts
    states = bytearray(map(_BY_REF.__getitem__, map(min, refs, repeat(2))))
    for block_id in blocks.cached_block_ids():
        if states[block_id] == FREE:
            states[block_id] = CACHED
    if blocks.null_block_id is not None:
        states[blocks.null_block_id] = RESERVED
    return states


def group_states(blocks: BlockMapSnapshot, states: bytearray) -> list[bytearray]:
    """Per KV cache group, [num_pool_blocks] states: `states` (the device map) where the group holds or caches the
    block, OTHER where another group does, FREE and RESERVED as they are."""
    owner = bytearray(len(states))  # 1 + the group holding or caching each block; 0: none
    for gi in range(blocks.num_groups):
        for _, ids in blocks.group_tables(gi):
            for block_id in ids:
                owner[block_id] = gi + 1
    for gi, cached in enumerate(blocks.cached_group_ids()):
        for block_id in cached:
            owner[block_id] = owner[block_id] or gi + 1
    out = []
    for gi in range(blocks.num_groups):
        # OTHER (the largest state) where another group holds the block, 0 elsewhere; then max with the states,
        # all at C speed (a gemma3 pool has 6 groups of some 16k blocks).
        others = bytes(OTHER if holder not in (0, gi + 1) else 0 for holder in range(256))
        out.append(bytearray(map(max, states, owner.translate(others))))
    return out


def encode_groups(blocks: BlockMapSnapshot, states: bytearray) -> list[dict[str, Any]]:
    """Each KV cache group's map (run-length encoded), its window and counts, for a frame."""
    out = []
    for gi, mine in enumerate(group_states(blocks, states)):
        counts = [mine.count(s) for s in (FREE, CACHED, OWNED, SHARED, OTHER)]
        out.append(
            {
                "group": gi,
                "sliding_window": blocks.sliding_windows[gi],
                "map": run_length(mine),
                "counts": dict(zip(GROUP_STATE_NAMES, counts, strict=True)),
            }
        )
    return out


def host_states(blocks: BlockMapSnapshot) -> bytearray:
    """[num_host_blocks] state of each host block: SWAPPED when a swapped sequence holds it."""
    return bytearray(SWAPPED if r else FREE for r in blocks.host_ref_counts())


def _entry(e: QueueEntry) -> list[Any]:
    return [e.request_id, e.num_computed_tokens, e.num_tokens, e.num_prompt_tokens, e.chunk, e.priority]


def encode_queues(queues: QueueView) -> dict[str, list[list[Any]]]:
    """Each queue as rows [id, computed, total, prompt, chunk, priority]."""
    return {
        "running": [_entry(e) for e in queues.running],
        "waiting": [_entry(e) for e in queues.waiting],
        "swapped": [_entry(e) for e in queues.swapped],
    }


def encode_replica(snap: ReplicaSnapshot) -> dict[str, Any]:
    """One replica's part of a frame (JSON-ready)."""
    stats = snap.stats
    out: dict[str, Any] = {
        "replica": snap.replica,
        "block_size": stats.block_size,
        "queues": encode_queues(snap.queues),
        "kv_usage": stats.kv_cache_usage,
    }
    blocks = snap.blocks
    if blocks is None:
        out["num_blocks"] = stats.num_kv_blocks
        out["map"] = None
        return out
    refs = blocks.ref_counts()
    states = device_states(blocks, refs)
    host = host_states(blocks)
    counts = [states.count(s) for s in range(len(STATE_NAMES))]
    counts[SWAPPED] = host.count(SWAPPED)
    out.update(
        num_blocks=blocks.num_pool_blocks,
        num_host_blocks=blocks.num_host_blocks,
        map=run_length(states),
        refs=run_length(refs),
        host_map=run_length(host),
        counts=dict(zip(STATE_NAMES, counts, strict=True)),
        tables={seq_id: id_runs(ids) for seq_id, ids in blocks.tables()},
        swapped_tables={seq_id: id_runs(ids) for seq_id, ids in blocks.swapped_tables()},
    )
    if blocks.null_block_id is not None or blocks.num_groups > 1:
        out["counts"]["reserved"] = states.count(RESERVED)
        out["groups"] = encode_groups(blocks, states)
        # Every group's tables (group 0's are `tables`), for hovering a group's map.
        out["group_tables"] = [
            {seq_id: id_runs(ids) for seq_id, ids in blocks.group_tables(gi)}
            for gi in range(blocks.num_groups)
        ]
    return out
