"""`start_core_client`: the engine-core client `pagoda serve` builds from its flags."""

from __future__ import annotations

import logging

from pagoda.server.config import DistributedExecutorBackendName, EngineConfig
from pagoda.server.core.client import DEFAULT_READY_TIMEOUT_S, CoreClient
from pagoda.server.procs import Launcher as CoreLauncher
from pagoda.server.procs import ProcessLauncher
from pagoda.server.routing import RoutingPolicyName, build_router


def start_core_client(
    config: EngineConfig,
    *,
    data_parallel_size: int,
    routing_policy: RoutingPolicyName,
    backend: DistributedExecutorBackendName,
    log_level: int = logging.INFO,
    ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
    ray_num_cpus: float = 1.0,
) -> CoreClient:
    """Start `data_parallel_size` engine cores (local processes for "mp", Ray actors for "ray") behind a router."""
    launcher: CoreLauncher
    if backend == "ray":
        from pagoda.server.procs.ray_launcher import RayLauncher

        launcher = RayLauncher(ray_num_cpus, _gpus_per_replica(config), log_level)
    else:
        launcher = ProcessLauncher(data_parallel_size, log_level)
    # The prefix index is bounded by a replica's KV capacity when the config fixes it (the engine's own pool
    # evicts beyond it); otherwise by the router's default, an upper bound for the KV sizes CPUs serve.
    router = build_router(
        routing_policy, data_parallel_size, config.block_size, max_blocks_per_replica=config.num_kv_blocks
    )
    return CoreClient(config, launcher, router, data_parallel_size, ready_timeout=ready_timeout)


def _gpus_per_replica(config: EngineConfig) -> float:
    """GPUs each Ray replica asks for: one per tensor-parallel rank on CUDA, none on the CPU."""
    if config.device is not None:
        return float(config.tensor_parallel_size) if config.device.startswith("cuda") else 0.0
    import torch

    return float(config.tensor_parallel_size) if torch.cuda.is_available() else 0.0
