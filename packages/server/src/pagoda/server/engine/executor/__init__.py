"""Executors: how one engine's steps run on the model (one process, or tensor-parallel ranks)."""

from __future__ import annotations

from pagoda.server.config import EngineConfig
from pagoda.server.engine.executor.base import Executor, ExecutorError, UniProcExecutor
from pagoda.server.engine.setup import EngineParts, build_parts, with_lora

__all__ = ["Executor", "ExecutorError", "UniProcExecutor", "build_executor"]


def build_executor(config: EngineConfig) -> tuple[Executor, EngineParts]:
    """The executor `tensor_parallel_size` (or `attention_ffn_disaggregation`) asks for, with the driver's parts
    (rank 0's shard under TP)."""
    if config.parallel_config.attention_ffn_disaggregation is not None:
        from pagoda.server.engine.executor.afd import AFDExecutor

        return AFDExecutor.launch(config)
    if config.parallel_config.tensor_parallel_size == 1:
        parts = with_lora(config, build_parts(config))
        return UniProcExecutor(parts.runner()), parts
    from pagoda.server.engine.executor.distributed import DistributedExecutor

    return DistributedExecutor.launch(config)
