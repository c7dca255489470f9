"""`start_core_client`: the engine-core client `pagoda serve` builds from its config's `core` section."""

from __future__ import annotations

import logging

from pagoda.server.config import CoreClientConfig, EngineConfig
from pagoda.server.core.client import CoreClient
from pagoda.server.core.disagg import roles_of
from pagoda.server.procs import Launcher, ProcessLauncher
from pagoda.server.routing import build_router


def start_core_client(
    config: EngineConfig,
    core: CoreClientConfig,
    *,
    log_level: int = logging.INFO,
    ray_num_cpus: float = 1.0,
) -> CoreClient:
    """Start `data_parallel_size` engine cores (local processes for "mp", Ray actors for "ray") behind a router."""
    launcher: Launcher
    if config.parallel_config.distributed_executor_backend == "ray":
        from pagoda.server.procs.ray_launcher import RayLauncher

        launcher = RayLauncher(ray_num_cpus, _gpus_per_replica(config), log_level)
    else:
        launcher = ProcessLauncher(core.data_parallel_size, log_level, cpus=core.replica_cpus)
    # The prefix index is bounded by a replica's KV capacity when the config fixes it (the engine's own pool
    # evicts beyond it); otherwise by the router's default, an upper bound for the KV sizes CPUs serve.
    cache = config.cache_config
    router = build_router(
        core.routing_policy,
        core.data_parallel_size,
        cache.block_size,
        max_blocks_per_replica=cache.num_kv_blocks,
        use_kv_events=core.routing_kv_events,
    )
    return CoreClient(
        config,
        launcher,
        router,
        core.data_parallel_size,
        ready_timeout=core.engine_ready_timeout,
        send_hwm=core.replica_send_hwm,
        stall_timeout=core.replica_stall_timeout,
        routing_kv_events=core.routing_kv_events,
        roles=roles_of(core.prefill_replicas, core.decode_replicas) if core.disaggregated else None,
        kv_transfer=core.kv_transfer,
    )


def _gpus_per_replica(config: EngineConfig) -> float:
    """GPUs each Ray replica asks for: one per tensor-parallel rank on CUDA, none on the CPU."""
    device, size = config.model_config.device, config.parallel_config.tensor_parallel_size
    if device is not None:
        return float(size) if device.startswith("cuda") else 0.0
    import torch

    return float(size) if torch.cuda.is_available() else 0.0
