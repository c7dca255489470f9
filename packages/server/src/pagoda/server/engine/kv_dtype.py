"""`--kv-cache-dtype`: the KV cache's storage dtype, and where each one can run."""

from __future__ import annotations

import torch
from pagoda.pagedkernel import kv_quant
from pagoda.server.config import EngineConfig


class KVCacheDtypeError(ValueError):
    """A --kv-cache-dtype this device cannot run; the message says why and what to use instead."""


def storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache tensors hold for `--kv-cache-dtype name` ("auto": the model's)."""
    return kv_quant.storage_dtype(name, model_dtype)


def check_kv_cache_dtype(config: EngineConfig, device: torch.device | None = None) -> None:
    """KVCacheDtypeError when the configured KV dtype cannot run on `device` (default: the configured or detected
    one): fp8 is CUDA only. On the CPU only the torch reference attends over fp8 (the C kernel takes int8), and
    that gathers and converts every visible block per layer: a decode of 8 x 1,024 tokens took 4.5x the C
    kernel's time (README), so an fp8 cache would slow every step instead of helping; int8 halves the bytes too."""
    name = config.cache_config.kv_cache_dtype
    if name == "auto" or name == "int8":
        return
    if device is None:
        configured = config.model_config.device
        device = torch.device(configured or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        raise KVCacheDtypeError(
            f"--kv-cache-dtype {name} (kv_cache_dtype) needs CUDA (its Triton/CuPy kernels); on {device.type} only the torch "
            "reference reads fp8, several times slower than the C kernel: use --kv-cache-dtype int8 (half the "
            "bytes of bfloat16, C kernels) or auto"
        )
