"""Building one rank's LoRA slot pool from the engine's config (the engine's driver and every tensor-parallel
worker build theirs the same way)."""

from __future__ import annotations

import torch
from pagoda.pagedkernel.lora import LoRABackendName
from pagoda.server.config import EngineConfig
from pagoda.server.lora.manager import LoRAManager
from pagoda.server.models.base import CausalLM

DEFAULT_MAX_LORAS = 1  # vLLM's default of --max-loras


def max_loras(config: EngineConfig) -> int | None:
    """Distinct adapters one step may use (the scheduler's admission cap): `max_loras`, or vLLM's default of 1,
    with `enable_lora`; None without."""
    if not config.lora_config.enable_lora:
        return None
    return config.scheduler_config.max_loras or DEFAULT_MAX_LORAS


def lora_backend(kernel_backend: str) -> LoRABackendName:
    """The LoRA op's backend for the engine's kernel backend (cpu, torch and triton as named, else auto)."""
    return kernel_backend if kernel_backend in ("torch", "cpu", "triton") else "auto"  # type: ignore[return-value]


def build_manager(
    config: EngineConfig, model: CausalLM, dtype: torch.dtype, device: torch.device
) -> LoRAManager | None:
    """The slot pool and hooks of one rank's model (None without `enable_lora`); tensor-parallel workers build
    theirs from the same config, and read each adapter, cut to their shard, when a step first uses it."""
    cap = max_loras(config)
    if cap is None:
        return None
    lora_config = config.lora_config
    return LoRAManager(
        model,
        max_loras=cap,
        max_lora_rank=lora_config.max_lora_rank,
        max_cpu_loras=lora_config.max_cpu_loras or cap,
        dtype=dtype,
        device=device,
        backend=lora_backend(config.model_config.kernel_backend),
    )
