"""`TieredOffload`: the KV connector of the host and disk tiers (vLLM's native offloading, SGLang's HiCache).

Write-through: every block a step computes is copied to the host tier after the step (a few microseconds per
block: a block is ~300 KB on the default model, against the milliseconds its tokens took to compute), so a
block the device pool evicts later is already there, and a prefix one replica computed is at once a hit for
the others. With a disk tier each newly stored block is also queued for the disk, written by the disk store's
own thread; a request whose prefix is on disk only is held at admission while its blocks are read into the
host tier (`prefetch`), then loads from the host tier like any other hit.

With an event sink (`set_event_sink`: the engine's KV events publisher under the tier's medium) every group-0
block the host tier stores is a `BlockStored`, and every group-0 block a store evicts a `BlockRemoved`, so a
cache-aware router knows what the shared tier holds for every replica on the host.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from pagoda.blockalloc import BlockHash, KVEventSink
from pagoda.blockalloc.groups import is_first_group_key
from pagoda.server.kv_tiers.blocks import BlockRows
from pagoda.server.kv_tiers.connector import KVTierStats
from pagoda.server.kv_tiers.host import SharedHostStore
from pagoda.server.kv_tiers.peer import PeerTransfer

logger = logging.getLogger(__name__)


class DiskStats(Protocol):
    """The disk tier's counters as the connector reports them (`pagoda.server.kv_tiers.disk.DiskTierStats`)."""

    @property
    def hits(self) -> int:
        """Blocks read back (served to the host tier)."""
        ...

    @property
    def bytes_read(self) -> int:
        """Bytes read out of the tier."""
        ...

    @property
    def bytes_written(self) -> int:
        """Bytes written into the tier."""
        ...

    @property
    def occupancy_bytes(self) -> int:
        """Bytes the tier's block files hold now."""
        ...

    @property
    def capacity_bytes(self) -> int:
        """The tier's size limit."""
        ...


class DiskStore(Protocol):
    """The disk tier as the connector uses it (`pagoda.server.kv_tiers.disk.DiskKVStore`)."""

    def contains(self, key: bytes) -> bool:
        """Whether a block file of `key` exists."""
        ...

    def put(self, key: bytes, payload: bytes | bytearray | memoryview) -> bool:
        """Queue an asynchronous write; False when dropped."""
        ...

    def get(self, key: bytes) -> bytes | None:
        """The verified payload of `key`, or None."""
        ...

    def stats(self) -> DiskStats:
        """The disk tier's counters and occupancy."""
        ...

    def close(self) -> None:
        """Drain the queue and stop the writer."""
        ...


class TieredOffload:
    """The host tier (shared memory), optionally backed by a disk tier: a `KVConnector`."""

    def __init__(
        self,
        rows: BlockRows,
        host: SharedHostStore,
        disk: DiskStore | None = None,
        peers: PeerTransfer | None = None,
    ) -> None:
        """Move blocks of `rows`' cache through `host` (and `disk`; with `peers`, to and from other engines'
        host tiers over TCP: `kv_tiers/peer.py`)."""
        if host.slot_bytes != rows.slot_bytes:
            raise ValueError(f"host tier slots of {host.slot_bytes} bytes for blocks of {rows.slot_bytes}")
        self.rows = rows
        self.host = host
        self.disk = disk
        # [num_slots, slot_bytes] uint8 over the shared file: the slots as one tensor
        self.slots = torch.frombuffer(
            host.data, dtype=torch.uint8, offset=host.data_offset, count=host.num_slots * host.slot_bytes
        ).view(host.num_slots, host.slot_bytes)
        self._pinned: dict[BlockHash, int] = {}  # acquired, not loaded yet: key -> slot
        self.peers = peers
        slow = disk is not None or peers is not None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-read") if slow else None
        self.host_hits = self.host_in = self.host_out = 0
        self.disk_hits = self.disk_out = 0
        self.peer_hits = self.peer_in = 0
        self.block_size = rows.kv_cache.shape.block_size
        self._events: KVEventSink | None = None

    def set_event_sink(self, sink: KVEventSink | None) -> None:
        """Tell `sink` every group-0 block the host tier stores or evicts (None: stop telling)."""
        self._events = sink

    def _stored(self, keys: Sequence[BlockHash], evicted: Sequence[bytes | None]) -> None:
        """Publish one store's evictions, then its new blocks (group 0's keys: the content hashes)."""
        if self._events is None:
            return
        removed = [BlockHash(k) for k in evicted if k is not None and is_first_group_key(BlockHash(k))]
        if removed:
            self._events.blocks_removed(removed)
        stored = [k for k in keys if is_first_group_key(k)]
        if stored:
            # A tier's blocks are known by hash only: no parent or tokens (routers match hashes).
            self._events.blocks_stored(stored, None, [], self.block_size)

    # ------------------------------------------------------------ scheduler side

    def contains(self, key: BlockHash) -> bool:
        """Whether the host tier holds `key`."""
        return self.host.contains(key)

    def acquire(self, keys: Sequence[BlockHash]) -> bool:
        """Pin the host slots of `keys` until `start_load`."""
        slots = self.host.acquire(keys)
        if slots is None:
            return False
        self._pinned.update(zip(keys, slots, strict=True))
        return True

    def prefetch(self, keys: Sequence[BlockHash], source: str | None = None) -> Future[None] | None:
        """Read the keys only the disk holds (or, with `source`, another engine's KV block server) into the host
        tier, on the reader thread; None without any."""
        if source is not None and self.peers is not None and self._reader is not None:
            missing = [key for key in keys if not self.host.contains(key)]
            return self._reader.submit(self._pull, source, missing) if missing else None
        if self.disk is None or self._reader is None:
            return None
        wanted: list[BlockHash] = []
        for key in keys:
            if self.host.contains(key):
                continue
            if self.disk.contains(key):
                wanted.append(key)
            elif is_first_group_key(key):
                break  # group 0's chain ends here: nothing after it can be a hit (and a lookup may cost a stat)
        return self._reader.submit(self._promote, wanted) if wanted else None

    def _promote(self, keys: Sequence[BlockHash]) -> None:
        """Disk -> host, block by block; a bad or vanished file is a miss (recomputed), never an error."""
        assert self.disk is not None
        for key in keys:
            payload = self.disk.get(key)
            if payload is None or len(payload) != self.host.slot_bytes:
                continue
            reserved = self.host.reserve(key)
            if reserved is None:
                continue
            slot, evicted = reserved
            self.host.slot(slot)[:] = payload
            self.host.commit(slot)
            self._stored([key], [evicted])
            self.disk_hits += 1
            self.disk_out += len(payload)

    def _pull(self, source: str, keys: Sequence[BlockHash]) -> None:
        """Another engine's blocks -> this host tier; a block it lacks (or sends whole no more) is recomputed."""
        assert self.peers is not None
        payloads = self.peers.fetcher.fetch(source, keys)
        for key, payload in zip(keys, payloads, strict=True):
            if payload is None or len(payload) != self.host.slot_bytes:
                continue
            reserved = self.host.reserve(key)
            if reserved is None:
                continue
            slot, evicted = reserved
            self.host.slot(slot)[:] = payload
            self.host.commit(slot)
            self._stored([key], [evicted])
            self.peer_hits += 1
            self.peer_in += len(payload)

    def request_finished(self, request_id: str) -> None:
        """Nothing: blocks were saved as they were computed."""

    # --------------------------------------------------------------- worker side

    def start_load(self, loads: Sequence[tuple[BlockHash, int]]) -> None:
        """Host slots -> device blocks, then unpin."""
        if not loads:
            return
        slots = [self._pinned.pop(key) for key, _ in loads]
        try:
            self.rows.from_rows(self.slots, slots, [block for _, block in loads])
        finally:
            self.host.release(slots)
        self.host_hits += len(loads)
        self.host_out += len(loads) * self.host.slot_bytes

    def wait_for_load(self) -> None:
        """CUDA: the current stream waits for the uploads (the CPU copied synchronously)."""
        self.rows.wait_for_load()

    def save(self, saves: Sequence[tuple[BlockHash, int]]) -> None:
        """Device blocks -> free (or least recently used) host slots; each newly stored block also to the disk."""
        reserved: list[tuple[BlockHash, int, int]] = []
        evicted: list[bytes | None] = []
        for (key, block), got in zip(saves, self.host.reserve_many([k for k, _ in saves]), strict=True):
            if got is not None:
                reserved.append((key, block, got[0]))
                evicted.append(got[1])
        if not reserved:
            return
        try:
            self.rows.to_rows([b for _, b, _ in reserved], self.slots, [s for _, _, s in reserved])
            self.rows.finish_save()  # the slots hold their bytes before they become hits
        except BaseException:
            for _, _, slot in reserved:
                self.host.abandon(slot)
            raise
        self.host.commit_many([slot for _, _, slot in reserved])
        for key, _, slot in reserved:
            if self.disk is not None:
                self.disk.put(key, self.host.slot(slot))
        self._stored([key for key, _, _ in reserved], evicted)
        self.host_in += len(reserved) * self.host.slot_bytes

    def wait_for_save(self) -> None:
        """Saves finish within `save` (a slot becomes a hit only once whole)."""

    def stats(self) -> tuple[KVTierStats, ...]:
        """The host tier's counters (this engine's) and occupancy (every replica's blocks), then the disk's."""
        host = self.host.stats()
        tiers = [
            KVTierStats(
                "host",
                self.host_hits,
                self.host_in,
                self.host_out,
                host.num_used * host.slot_bytes,
                host.num_slots * host.slot_bytes,
            )
        ]
        if self.disk is not None:
            disk = self.disk.stats()
            tiers.append(
                KVTierStats(
                    "disk",
                    disk.hits,
                    disk.bytes_written,
                    disk.bytes_read,
                    disk.occupancy_bytes,
                    disk.capacity_bytes,
                )
            )
        if self.peers is not None:
            server = self.peers.server
            tiers.append(KVTierStats("peer", self.peer_hits, self.peer_in, server.bytes_served, 0, 0))
        return tuple(tiers)

    @property
    def endpoint(self) -> str | None:
        """Where other engines pull this engine's blocks (None without peers)."""
        return None if self.peers is None else self.peers.server.endpoint

    def close(self) -> None:
        """Stop the reader, drain the disk's writes, leave the shared file."""
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
        if self.disk is not None:
            self.disk.close()
        if self.peers is not None:
            self.peers.close()
        if self._pinned:
            self.host.release(list(self._pinned.values()))
            self._pinned.clear()
        self.host.close()
