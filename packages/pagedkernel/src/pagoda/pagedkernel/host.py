"""Host-side KV cache allocation for swapping blocks out of device memory."""

from __future__ import annotations

import torch
from torch import Tensor


def allocate_host_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> Tensor:  # [num_blocks, block_size, num_kv_heads, head_dim] on the CPU
    """An uninitialised CPU cache tensor, pinned when CUDA is available so that swaps copy asynchronously."""
    return torch.empty(
        (num_blocks, block_size, num_kv_heads, head_dim),
        dtype=dtype,
        device="cpu",
        pin_memory=torch.cuda.is_available(),
    )
