"""The scheduler's two axes as the engine configures them: KV reservation (paged or contiguous) and policy."""

from __future__ import annotations

from pagoda.blockalloc import BlockManager
from pagoda.scheduler import (
    ContiguousKVManager,
    FCFSPolicy,
    KVBlockManager,
    PriorityPolicy,
    SchedulingPolicy,
    StaticBatchPolicy,
)
from pagoda.server.config import EngineConfig


def build_kv_manager(
    config: EngineConfig, num_blocks: int, num_host_blocks: int, max_model_len: int
) -> KVBlockManager:
    """The paged `BlockManager`, or a contiguous reservation of `max_model_len` per sequence over one.

    The contiguous manager's inner `BlockManager` has the engine's whole pool, so its slots and block tables
    index the real KV cache; it shares no prefix and never swaps (no host tier).
    """
    if config.kv_manager == "contiguous":
        inner = BlockManager(num_blocks, config.block_size, enable_prefix_caching=False)
        return ContiguousKVManager(inner, reserve_tokens=max_model_len)
    return BlockManager(
        num_blocks,
        config.block_size,
        num_host_blocks=num_host_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
    )


def build_policy(config: EngineConfig) -> SchedulingPolicy:
    """FCFS, priority, or static batches of up to max_num_seqs (formed after `static_batch_timeout_s`)."""
    if config.scheduling_policy == "priority":
        return PriorityPolicy()
    if config.scheduling_policy == "static":
        # The policy's clock is time.monotonic, the clock of the engine's arrival times.
        return StaticBatchPolicy(timeout_s=config.static_batch_timeout_s)
    return FCFSPolicy()
