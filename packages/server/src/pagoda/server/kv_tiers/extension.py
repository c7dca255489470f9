"""`KVTierExtension`: a KV connector plugged into the engine's extension seam.

- admission (`hold`): a request whose prompt blocks sit in a slow source (disk, another engine) waits while the
  connector's `prefetch` brings them where `contains` sees them; the scheduler then finds them as cached tokens;
- before the step runs (`before_execute`): the loads the step's allocations recorded are copied in;
- after the update (`after_update`): the blocks the step computed are saved out (only those still registered
  under their key: a block is never saved after it was reused);
- a request's end (`done`) and the engine's (`close`: queued disk writes finish).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

from pagoda.blockalloc import BlockHash, BlockManager, KVEventSink
from pagoda.blockalloc.groups import group_key
from pagoda.blockalloc.hashing import ROOT_BLOCK_HASH, hash_blocks, salt_bytes
from pagoda.scheduler import Scheduler, SchedulerOutput
from pagoda.server.engine.extension import Extension, Released, wait_for_any
from pagoda.server.engine.request_factory import NewRequest
from pagoda.server.engine.step_sampler import SampledStep
from pagoda.server.kv_tiers.connector import KVConnector

logger = logging.getLogger(__name__)


class KVTierExtension(Extension):
    """Drives a `KVConnector` from the engine's step: prefetch at admission, loads before, saves after."""

    def __init__(self, connector: KVConnector, kv: BlockManager) -> None:
        """Connect `kv`'s prefix cache to `connector`: its hits count as cached tokens from now on."""
        self.connector = connector
        self.kv = kv
        kv.set_tier(connector)
        self._held: dict[str, tuple[NewRequest, Future[None]]] = {}
        self._saves: list[tuple[BlockHash, int]] = []

    def prompt_keys(self, new: NewRequest) -> list[BlockHash]:
        """Every group's key of each full block of the prompt but its last token, in prefix order."""
        request = new.request
        tokens = request.block_key_ids
        num_blocks = (len(tokens) - 1) // self.kv.block_size
        hashes = hash_blocks(
            tokens, self.kv.block_size, 0, num_blocks, ROOT_BLOCK_HASH, salt_bytes(request.cache_salt)
        )
        groups = range(self.kv.num_kv_cache_groups)
        return [group_key(h, g) for h in hashes for g in groups]

    def hold(self, new: NewRequest) -> bool:
        """Hold `new` while the connector prefetches its prompt's blocks that no faster place holds."""
        cached: Callable[[BlockHash], bool] = self.kv.pool.cached_block_hash_to_block.__contains__
        keys = [k for k in self.prompt_keys(new) if not cached(k)]
        future = self.connector.prefetch(keys, new.kv_source) if keys else None
        if future is None:
            return False
        self._held[new.request.request_id] = (new, future)
        return True

    def release(self) -> Released:
        """The requests whose prefetch ended (a failed one just means its blocks are recomputed)."""
        ready: list[NewRequest] = []
        for request_id, (new, future) in list(self._held.items()):
            if future.done():
                del self._held[request_id]
                if future.exception() is not None:
                    logger.warning("KV prefetch for %s failed: %s", request_id, future.exception())
                ready.append(new)
        return Released(ready)

    def num_held(self) -> int:
        """Requests waiting for their prefetch."""
        return len(self._held)

    def wait(self, timeout: float) -> bool:
        """Wait for a prefetch to end."""
        return wait_for_any([future for _, future in self._held.values()], timeout)

    def before_execute(self, scheduled: SchedulerOutput) -> None:
        """Copy this step's loads in; keep its saves for after the step."""
        work = self.kv.take_tier_work()
        self.connector.start_load(work.loads)
        self.connector.wait_for_load()
        self._saves = work.saves

    def after_update(self, scheduler: Scheduler, sampled: SampledStep, now: float) -> None:
        """Save the blocks this step computed that still hold their content."""
        saves, self._saves = self._saves, []
        cache_map = self.kv.pool.cached_block_hash_to_block
        live = [
            (key, block)
            for key, block in saves
            if (b := cache_map.get(key)) is not None and b.block_id == block
        ]
        self.connector.save(live)
        self.connector.wait_for_save()

    def done(self, request_id: str) -> None:
        """Forget a held request; tell the connector."""
        self._held.pop(request_id, None)
        self.connector.request_finished(request_id)

    def publish_events(self, sink: KVEventSink | None) -> None:
        """Send the tier's stores and evictions to `sink` (the engine's KV events publisher, the tier's medium)."""
        self.connector.set_event_sink(sink)

    def close(self) -> None:
        """Close the connector (queued disk writes finish)."""
        self.connector.close()
