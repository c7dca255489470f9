"""KV cache events in vLLM's format (`BlockStored`, `BlockRemoved`, `AllBlocksCleared` in msgspec msgpack
batches `[timestamp, [events], data_parallel_rank]`), published over ZeroMQ PUB with a replay socket, for
routers that route by cache contents. `--kv-events-config` (vLLM's JSON keys) turns them on."""

from pagoda.server.kv_events.config import KVEventsConfig, parse_kv_events_config
from pagoda.server.kv_events.publisher import KVEventPublisher, start_kv_events
from pagoda.server.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEventsConfig",
    "parse_kv_events_config",
    "start_kv_events",
]
