"""A cheap, immutable picture of the allocator's state for live views (the dashboard).

Taken on the thread that owns the allocator, in O(num_blocks) C-level passes (`array` over `map(attrgetter)`),
with no Python object made per block; everything expensive (classifying, run-length encoding) happens later, on
another thread, from this copy alone.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

from pagoda.blockalloc.sequence import SeqId

if TYPE_CHECKING:
    from pagoda.blockalloc.manager import BlockManager

_REF_CNT = attrgetter("ref_cnt")
_BLOCK_ID = attrgetter("block_id")


@dataclass(frozen=True, slots=True)
class BlockMapSnapshot:
    """Ref counts of every block of both tiers, the cached block ids and each sequence's block table.

    The arrays are fresh copies owned by the snapshot: nobody mutates them after it is made.
    """

    block_size: int
    ref_counts: array[int]  # [num_blocks] device-tier ref count of each block
    cached_block_ids: array[int]  # device blocks holding a prefix-cache hash (referenced or evictable)
    host_ref_counts: array[int]  # [num_host_blocks] host-tier ref count (1: a swapped sequence holds it)
    tables: tuple[tuple[SeqId, array[int]], ...]  # device-resident sequences: id, block ids in token order
    swapped_tables: tuple[tuple[SeqId, array[int]], ...]  # swapped sequences: id, host block ids

    @property
    def num_blocks(self) -> int:
        """Device blocks."""
        return len(self.ref_counts)

    @property
    def num_host_blocks(self) -> int:
        """Host blocks."""
        return len(self.host_ref_counts)


def take_snapshot(manager: BlockManager) -> BlockMapSnapshot:
    """Copy what a live view needs out of `manager`; call it on the thread that mutates the manager."""
    return BlockMapSnapshot(
        block_size=manager.block_size,
        ref_counts=array("l", map(_REF_CNT, manager.pool.blocks)),
        cached_block_ids=array("l", map(_BLOCK_ID, manager.pool.cached_block_hash_to_block.values())),
        host_ref_counts=array("l", map(_REF_CNT, manager.host_pool.blocks)),
        tables=tuple(
            (seq_id, array("l", map(_BLOCK_ID, seq.blocks))) for seq_id, seq in manager.seqs.items()
        ),
        swapped_tables=tuple(
            (seq_id, array("l", map(_BLOCK_ID, seq.blocks))) for seq_id, seq in manager.swapped.items()
        ),
    )
