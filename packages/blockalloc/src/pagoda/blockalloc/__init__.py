"""pagoda.blockalloc: paged KV-cache block allocator (block pool, prefix caching, block tables, CoW, swap)."""

from pagoda.blockalloc.block import KVCacheBlock
from pagoda.blockalloc.events import KVEventSink
from pagoda.blockalloc.free_queue import FreeKVCacheBlockQueue
from pagoda.blockalloc.groups import FULL_ATTENTION, KVCacheGroupSpec
from pagoda.blockalloc.hashing import BlockHash, hash_block_tokens
from pagoda.blockalloc.manager import BlockManager
from pagoda.blockalloc.outputs import KVCacheStats, SlotAllocation
from pagoda.blockalloc.pool import BlockPool
from pagoda.blockalloc.sequence import SeqId
from pagoda.blockalloc.snapshot import BlockMapSnapshot
from pagoda.blockalloc.tiers import KVTierIndex, TierWork

__all__ = [
    "FULL_ATTENTION",
    "BlockHash",
    "BlockManager",
    "BlockMapSnapshot",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheGroupSpec",
    "KVCacheStats",
    "KVEventSink",
    "KVTierIndex",
    "SeqId",
    "SlotAllocation",
    "TierWork",
    "hash_block_tokens",
]
