"""Building the KV tiers from the cache config: the host tier's shared file, the disk tier, the connector."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from pagoda.blockalloc import BlockManager
from pagoda.scheduler import KVBlockManager
from pagoda.server.config import CacheConfig, EngineConfig
from pagoda.server.engine.executor import Executor
from pagoda.server.engine.kv_cache import KVCache
from pagoda.server.engine.setup import EngineConfigError
from pagoda.server.kv_tiers.blocks import BlockRows, kv_identity
from pagoda.server.kv_tiers.extension import KVTierExtension
from pagoda.server.kv_tiers.host import SharedHostStore, new_host_tier_path
from pagoda.server.kv_tiers.offload import DiskStore, TieredOffload
from pagoda.server.kv_tiers.peer import KVTransferSpec, PeerTransfer

logger = logging.getLogger(__name__)

GIB = 1 << 30
# The host tier a disk tier reads into when --kv-offloading-size is not given.
DEFAULT_STAGING_GIB = 0.5


def with_shared_host_tier(config: EngineConfig) -> tuple[EngineConfig, Path | None]:
    """`config` naming a new shared-memory file for its host tier, and that file (which the caller removes when
    the server exits); unchanged and None without tiers or when a file is named already."""
    cache = config.cache_config
    if not cache.kv_tiers_enabled or cache.kv_offloading_shm is not None:
        return config, None
    path = new_host_tier_path()
    return replace(config, cache_config=replace(cache, kv_offloading_shm=str(path))), path


def check_host_tier_size(cache: CacheConfig) -> None:
    """ValueError naming --kv-offloading-size when the host tier would not fit in the machine's memory."""
    size = cache.kv_offloading_size
    if size is None:
        return
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size * GIB > total:
        raise ValueError(
            f"--kv-offloading-size {size:g} GiB is more than this machine's memory ({total / GIB:.1f} GiB)"
        )


def check_kv_tier_flags(cache: CacheConfig) -> None:
    """ValueError naming the flag for a host tier larger than memory or a disk folder or size the disk tier
    refuses (the CLI exits 2 before anything loads)."""
    check_host_tier_size(cache)
    if cache.kv_offloading_disk_path is not None and cache.kv_offloading_disk_size is not None:
        from pagoda.server.kv_tiers.disk import check_disk_tier

        check_disk_tier(cache.kv_offloading_disk_path, cache.kv_offloading_disk_size)


def model_files_identity(model_path: Path) -> str:
    """The model's files as names, sizes and modification times: a changed model never reads old KV blocks."""
    files = [model_path] if model_path.is_file() else sorted(p for p in model_path.iterdir() if p.is_file())
    return ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def build_kv_tiers(
    config: EngineConfig,
    kv_cache: KVCache,
    kv: BlockManager,
    model_path: Path,
    transfer: KVTransferSpec | None = None,
) -> KVTierExtension | None:
    """The tiers' engine extension, connected to `kv` (and with `transfer`, serving and pulling blocks over TCP);
    None when no tier is configured."""
    cache = config.cache_config
    if not cache.kv_tiers_enabled:
        return None
    check_host_tier_size(cache)
    rows = BlockRows(kv_cache)
    identity = kv_identity(model_files_identity(model_path), kv_cache)
    if cache.kv_offloading_shm is None:
        path, owner = new_host_tier_path(), True
    else:
        path, owner = Path(cache.kv_offloading_shm), False
    size_gib = cache.kv_offloading_size or DEFAULT_STAGING_GIB
    host = SharedHostStore.open(path, int(size_gib * GIB), rows.slot_bytes, identity, owner=owner)
    disk: DiskStore | None = None
    peers: PeerTransfer | None = None
    try:
        if cache.kv_offloading_disk_path is not None and cache.kv_offloading_disk_size is not None:
            from pagoda.server.kv_tiers.disk import DiskKVStore, check_disk_tier

            folder = check_disk_tier(cache.kv_offloading_disk_path, cache.kv_offloading_disk_size)
            disk = DiskKVStore(folder, int(cache.kv_offloading_disk_size * GIB), identity, rows.slot_bytes)
        if transfer is not None:
            peers = PeerTransfer.start(host, transfer.keys, transfer.bind_host)
        connector = TieredOffload(rows, host, disk, peers)
    except BaseException:
        if peers is not None:
            peers.close()
        if disk is not None:
            disk.close()
        host.close()
        raise
    logger.info(
        "KV tiers: host %.2f GiB (%d blocks of %d KiB, %s)%s",
        size_gib,
        host.num_slots,
        rows.slot_bytes // 1024,
        path,
        ""
        if disk is None
        else f", disk {cache.kv_offloading_disk_size:g} GiB in {cache.kv_offloading_disk_path}",
    )
    return KVTierExtension(connector, kv)


def kv_tiers_for(
    config: EngineConfig,
    executor: Executor,
    draft: object | None,
    kv: KVBlockManager,
    model_path: Path,
    transfer: KVTransferSpec | None = None,
) -> KVTierExtension | None:
    """The engine's KV tiers (None when none is configured); EngineConfigError for what they cannot serve yet."""
    if not config.cache_config.kv_tiers_enabled:
        return None
    if config.parallel_config.tensor_parallel_size > 1:
        raise EngineConfigError(
            "KV tiers (--kv-offloading-size) run with tensor_parallel_size 1 only (for now)"
        )
    if draft is not None:
        raise EngineConfigError("KV tiers (--kv-offloading-size) do not hold a draft model's KV (for now)")
    if not isinstance(kv, BlockManager):
        raise EngineConfigError("KV tiers need the paged KV manager")
    runner = executor.driver
    return build_kv_tiers(config, runner.kv_cache, kv, model_path, transfer)
