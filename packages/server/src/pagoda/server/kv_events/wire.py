"""The wire format, field for field vLLM's (vllm/distributed/kv_events.py): array-like, tagged msgspec Structs
in msgpack; a batch is `[ts, [events], data_parallel_rank]` and each event `[tag, *fields]`."""

from __future__ import annotations

import msgspec

# The medium of the host KV tier's events (pagoda.server.kv_tiers). vLLM's offloading connector says "CPU", but a
# Pagoda engine on the CPU already names its device pool "CPU": the shared tier needs a name of its own, which a
# router reads as "held for every replica on the host" (routing/event_index.py).
HOST_TIER_MEDIUM = "CPU_TIER"
TIER_MEDIA = frozenset({HOST_TIER_MEDIUM})


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events: the tag is the class name."""


class BlockStored(_Event):
    """Full blocks of one chain became cache hits: their hashes, the parent's, their tokens."""

    block_hashes: list[bytes]  # the prefix cache's sha256 chain hashes (32 bytes each)
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None  # "GPU" for the device tier (vLLM's name), "CPU" on a CPU engine, HOST_TIER_MEDIUM


class BlockRemoved(_Event):
    """Hashes evicted from the cache."""

    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(_Event):
    """The cache was reset."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one publishing interval."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None
