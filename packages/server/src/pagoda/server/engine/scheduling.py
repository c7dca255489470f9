"""KV reservation as the engine configures it: paged, or contiguous (the scheduler builds its own policy)."""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.blockalloc import FULL_ATTENTION, BlockManager, KVCacheGroupSpec
from pagoda.scheduler import ContiguousKVManager, KVBlockManager
from pagoda.server.config import EngineConfig
from pagoda.server.engine.kv_cache import KVCacheShape


def build_kv_manager(
    config: EngineConfig,
    num_blocks: int,
    num_host_blocks: int,
    max_model_len: int,
    groups: Sequence[KVCacheGroupSpec] = (FULL_ATTENTION,),
) -> KVBlockManager:
    """The paged `BlockManager`, or a contiguous reservation of `max_model_len` per sequence over one.

    The contiguous manager's inner `BlockManager` has the engine's whole pool, so its slots and block tables
    index the real KV cache; it shares no prefix and never swaps (no host tier).
    """
    cache = config.cache_config
    if cache.kv_manager == "contiguous":
        inner = BlockManager(num_blocks, cache.block_size, enable_prefix_caching=False)
        return ContiguousKVManager(inner, reserve_tokens=max_model_len)
    return BlockManager(
        num_blocks,
        cache.block_size,
        num_host_blocks=num_host_blocks,
        enable_prefix_caching=config.scheduler_config.enable_prefix_caching,
        groups=groups,
    )


def kv_cache_groups(shape: KVCacheShape) -> tuple[KVCacheGroupSpec, ...]:
    """The block manager's groups for a KV cache: its layout's, or one full-attention group."""
    return (FULL_ATTENTION,) if shape.layout is None else shape.layout.groups
