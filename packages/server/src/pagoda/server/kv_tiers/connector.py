"""The KV connector API: how KV blocks move between an engine's paged pool and anything outside it.

vLLM's `KVConnectorBase_V1` is the model; the names map as follows. The connector is one object with two sides:

**Scheduler side** (the allocator asks it, through `pagoda.blockalloc.KVTierIndex`):
- `contains(key)`: whether the connector can supply the block of a prefix-cache key now; the allocator counts
  such blocks as cached tokens (vLLM's `get_num_new_matched_tokens`);
- `acquire(keys)`: pin the blocks an allocation will load (vLLM's `update_state_after_alloc`); the allocator
  then records (key, device block) loads and, for every block whose content a step computes, (key, device
  block) saves: `BlockManager.take_tier_work()` is the step's connector metadata (`build_connector_meta`);
- `prefetch(keys)`: start bringing blocks from a slow source (disk, another engine) where `contains` sees
  them; the engine holds the request at admission until it completes (vLLM's asynchronous loads).

**Worker side** (the engine calls it around the model's forward pass):
- `start_load(loads)` before the step runs, `wait_for_load()` before attention reads the blocks;
- `save(saves)` after the step ran (the blocks hold their content), `wait_for_save()` before the blocks may be
  written again;
- `request_finished(request_id)`: a request ended (a connector that moves a finished request's blocks elsewhere,
  as prefill/decode disaggregation does, starts that here).

Observability: `stats()` (per tier: hits, bytes in and out, occupancy; `EngineStats.kv_tiers`, /metrics, the
dashboard) and `set_event_sink` (the tier's stores and evictions as KV cache events, vLLM's
`take_events`, for cache-aware routers).

Keys are `group_key`s of chained content hashes: digests stable across processes and restarts, salted per API
key and `cache_salt`, so nothing crosses tenants. A connector plugs into the engine through the extension seam
(`KVTierExtension`), never as a branch in `step()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from pagoda.blockalloc import BlockHash, KVEventSink


@dataclass(frozen=True, slots=True)
class KVTierStats:
    """One tier's counters since start (blocks and bytes) and its occupancy now."""

    tier: str  # "host" or "disk"
    hits: int  # blocks served to the device pool (host) or to the host tier (disk)
    bytes_in: int  # bytes written into the tier
    bytes_out: int  # bytes read out of the tier
    used_bytes: int
    capacity_bytes: int


class KVConnector(Protocol):
    """Moves KV blocks between the device pool and a tier (or another engine): both sides of the API."""

    # ------------------------------------------------------------ scheduler side
    def contains(self, key: BlockHash) -> bool:
        """Whether the block of `key` can be loaded now (a hint: `acquire` decides)."""
        ...

    def acquire(self, keys: Sequence[BlockHash]) -> bool:
        """Pin every key for the next `start_load`; False (pinning none) when one is gone."""
        ...

    def prefetch(self, keys: Sequence[BlockHash], source: str | None = None) -> Future[None] | None:
        """Start making the blocks of `keys` (in prefix order) loadable, from `source` (another engine's KV block
        server) when given; None when there is nothing to wait for."""
        ...

    def request_finished(self, request_id: str) -> None:
        """A request ended."""
        ...

    # --------------------------------------------------------------- worker side
    def start_load(self, loads: Sequence[tuple[BlockHash, int]]) -> None:
        """Copy the acquired blocks into their device blocks (key, block id); unpins them once copied."""
        ...

    def wait_for_load(self) -> None:
        """Block until every started load has landed."""
        ...

    def save(self, saves: Sequence[tuple[BlockHash, int]]) -> None:
        """Copy computed device blocks (key, block id) out, skipping keys the tier holds already."""
        ...

    def wait_for_save(self) -> None:
        """Block until every started save has read its device blocks."""
        ...

    def stats(self) -> tuple[KVTierStats, ...]:
        """Per tier: hits, bytes in and out, occupancy."""
        ...

    def set_event_sink(self, sink: KVEventSink | None) -> None:
        """Tell `sink` (KV cache events under the tier's medium) the blocks the tier stores and evicts."""
        ...

    def close(self) -> None:
        """Finish queued writes (a graceful stop keeps the disk tier) and release shared memory."""
        ...
