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

    def tables(self) -> tuple[tuple[SeqId, array[int]], ...]:
        """Each device-resident sequence's block ids, in token order."""
        return tuple((seq_id, array("l", map(_BLOCK_ID, blocks))) for seq_id, blocks in self._tables)

    def swapped_tables(self) -> tuple[tuple[SeqId, array[int]], ...]:
        """Each swapped sequence's host block ids."""
        return tuple((seq_id, array("l", map(_BLOCK_ID, blocks))) for seq_id, blocks in self._swapped)

    def cached_block_ids(self) -> array[int]:
        """Device blocks that held a prefix-cache hash (referenced or evictable)."""
        return array("l", map(_BLOCK_ID, self._cached))

    def ref_counts(self) -> array[int]:
        """[num_blocks] each device block's ref count: the number of tables holding it."""
        return _counts(self._tables, self.num_blocks)

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
    return BlockMapSnapshot(
        block_size=manager.block_size,
        num_blocks=manager.num_blocks,
        num_host_blocks=manager.num_host_blocks,
        _tables=tuple((seq_id, tuple(seq.blocks)) for seq_id, seq in manager.seqs.items()),
        _swapped=tuple((seq_id, tuple(seq.blocks)) for seq_id, seq in manager.swapped.items()),
        _cached=tuple(manager.pool.cached_block_hash_to_block.values()),
    )
