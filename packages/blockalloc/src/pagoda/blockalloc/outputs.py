"""Frozen records the block manager hands to its callers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlotAllocation:
    """Result of `BlockManager.allocate_slots`: where the new tokens go and which blocks to copy first."""

    slots: tuple[int, ...]  # slot of each new token, in order: block_id * block_size + offset
    # Copy-on-write (src_block, dst_block) pairs to perform BEFORE writing.
    copies: tuple[tuple[int, int], ...]
    num_cached_tokens: int  # tokens of this sequence served by the prefix cache (0 unless new)
    # With several KV cache groups: the new tokens' slots in each group's own blocks (group 0's are `slots`);
    # empty with one group.
    group_slots: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A snapshot of block usage in both tiers and of prefix-cache effectiveness."""

    num_blocks: int
    num_free_blocks: int  # includes cached-evictable blocks
    num_used_blocks: int
    num_cached_evictable_blocks: int  # free blocks whose content is still in the prefix cache
    usage: float  # used / total, device tier (0.0 for an empty pool)
    num_host_blocks: int
    num_free_host_blocks: int
    prefix_cache_queries: int  # tokens looked up (counted once per new sequence allocation)
    prefix_cache_hits: int  # tokens served from the cache
    # With several KV cache groups: the device blocks each holds (empty with one group).
    num_used_blocks_per_group: tuple[int, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits over queries, 0.0 before any query."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
