"""A cheap, immutable picture of the allocator's state for live views (the dashboard).

Taken on the thread that owns the allocator, it only copies lists of block references (C-speed, no per-block
Python work): each sequence's table and the blocks holding a prefix-cache hash. Everything else is derived later,
on any thread, from those copies alone: ids are read from the blocks (a block's id never changes), and a block's
ref count is the number of tables that hold it (the allocator's invariant), so the live, mutable counters are
never read off the owner's thread.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING

from pagoda.blockalloc.block import KVCacheBlock
from pagoda.blockalloc.groups import key_group
from pagoda.blockalloc.hashing import BlockHash
from pagoda.blockalloc.sequence import SeqId

if TYPE_CHECKING:
    from pagoda.blockalloc.manager import BlockManager

_BLOCK_ID = attrgetter("block_id")
Tables = tuple[tuple[SeqId, tuple[KVCacheBlock, ...]], ...]


@dataclass(frozen=True, slots=True)
class BlockMapSnapshot:
    """Both tiers' block tables and the cached blocks at one instant; read it through its methods."""

    block_size: int
    num_blocks: int
    num_host_blocks: int
    _tables: Tables  # device-resident sequences and their blocks (only block_id is read from them)
    _swapped: Tables  # swapped sequences and their host blocks
    _cached: tuple[KVCacheBlock, ...]  # device blocks holding a prefix-cache hash at the instant
    # KV cache groups: each one's sliding window (None: full attention), the reserved null block's id (a
    # sliding-window group's stand-in for the blocks its window left behind), the tables of groups 1.. (group 0's
    # are `_tables`), and the prefix-cache keys of `_cached`, in its order (a key names its group).
    sliding_windows: tuple[int | None, ...] = (None,)
    null_block_id: int | None = None
    _group_tables: tuple[Tables, ...] = ()
    _cached_keys: tuple[BlockHash, ...] = ()

    @property
    def num_pool_blocks(self) -> int:
        """Device block ids are 0 .. num_pool_blocks - 1: `num_blocks` usable ones, and the null block if any."""
        return self.num_blocks + (self.null_block_id is not None)

    @property
    def num_groups(self) -> int:
        """KV cache groups (block tables per sequence)."""
        return len(self.sliding_windows)

    def tables(self) -> tuple[tuple[SeqId, array[int]], ...]:
        """Each device-resident sequence's block ids (group 0's), in token order."""
        if self.null_block_id is not None:
            return self.group_tables(0)
        return tuple((seq_id, array("l", map(_BLOCK_ID, blocks))) for seq_id, blocks in self._tables)

    def swapped_tables(self) -> tuple[tuple[SeqId, array[int]], ...]:
        """Each swapped sequence's host block ids."""
        return tuple((seq_id, array("l", map(_BLOCK_ID, blocks))) for seq_id, blocks in self._swapped)

    def cached_block_ids(self) -> array[int]:
        """Device blocks that held a prefix-cache hash (referenced or evictable)."""
        return array("l", map(_BLOCK_ID, self._cached))

    def group_tables(self, group: int) -> tuple[tuple[SeqId, array[int]], ...]:
        """Each device-resident sequence's block ids in `group`, in token order (null entries left out)."""
        tables = self._tables if group == 0 else self._group_tables[group - 1]
        null = self.null_block_id
        return tuple(
            (seq_id, array("l", (i for i in map(_BLOCK_ID, blocks) if i != null)))
            for seq_id, blocks in tables
        )

    def cached_group_ids(self) -> tuple[array[int], ...]:
        """Per group, the device blocks that held one of its prefix-cache keys."""
        out = tuple(array("l") for _ in self.sliding_windows)
        if len(out) == 1:
            return (self.cached_block_ids(),)
        for key, block in zip(self._cached_keys, self._cached, strict=True):
            out[key_group(key)].append(block.block_id)
        return out

    def ref_counts(self) -> array[int]:
        """[num_pool_blocks] each device block's ref count: the number of tables holding it, over every group (a
        block belongs to one group at a time; the null block counts 0)."""
        counts = _counts((*self._tables, *chain.from_iterable(self._group_tables)), self.num_pool_blocks)
        if self.null_block_id is not None:
            counts[self.null_block_id] = 0
        return counts

    def host_ref_counts(self) -> array[int]:
        """[num_host_blocks] each host block's ref count (1 while a swapped sequence holds it)."""
        return _counts(self._swapped, self.num_host_blocks)


def _counts(tables: Tables, size: int) -> array[int]:
    """Table references per block id."""
    counts = array("l", bytes(array("l").itemsize * size))  # zeros
    for block_id, n in Counter(map(_BLOCK_ID, chain.from_iterable(b for _, b in tables))).items():
        counts[block_id] = n
    return counts


def take_snapshot(manager: BlockManager) -> BlockMapSnapshot:
    """Copy what a live view needs out of `manager`; call it on the thread that mutates the manager."""
    seqs = manager.seqs
    cache_map = manager.pool.cached_block_hash_to_block
    several = len(manager.groups) > 1
    return BlockMapSnapshot(
        block_size=manager.block_size,
        num_blocks=manager.num_blocks,
        num_host_blocks=manager.num_host_blocks,
        _tables=tuple((seq_id, tuple(seq.blocks)) for seq_id, seq in seqs.items()),
        _swapped=tuple((seq_id, tuple(seq.blocks)) for seq_id, seq in manager.swapped.items()),
        _cached=tuple(cache_map.values()),
        sliding_windows=tuple(g.sliding_window for g in manager.groups),
        null_block_id=None if manager.null_block is None else manager.null_block.block_id,
        _group_tables=tuple(
            tuple((seq_id, tuple(seq.tables[gi])) for seq_id, seq in seqs.items())
            for gi in range(1, len(manager.groups))
        ),
        # Only several groups need to know whose key a cached block holds (the same order as `_cached`).
        _cached_keys=tuple(cache_map) if several else (),
    )
