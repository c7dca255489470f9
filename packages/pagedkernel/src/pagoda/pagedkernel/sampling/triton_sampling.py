"""The `triton` backend of the sampling op: one program per row (see triton_sampling_kernels), for CUDA, and on
the CPU under TRITON_INTERPRET=1 (how the tests run it)."""

from __future__ import annotations

from typing import Any

import torch
from pagoda.pagedkernel.sampling.triton_sampling_kernels import sample_kernel
from torch import Tensor

BLOCK = 1024  # vocabulary elements a program reads at a time


def _launch(kernel: Any, grid: tuple[int, ...], *args: object, **meta: object) -> None:
    """Launch `kernel` on `grid`; the one place the kernel starts (the compile test records launches here)."""
    kernel[grid](*args, **meta)


def run(
    logits: Tensor,  # [rows, vocab]
    inv_temperature: Tensor,  # float32 [rows]
    top_k: Tensor,  # int64 [rows]
    top_p: Tensor,  # float32 [rows]
    min_p: Tensor,  # float32 [rows]
    keys: Tensor,  # int64 [rows]
    *,
    with_mask: bool,
    block: int = BLOCK,
) -> tuple[Tensor, Tensor, Tensor | None]:  # int64 [rows], int32 [rows], bool [rows, vocab] or None
    """Launch the kernel: tokens, status and (with_mask) the kept mask."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    device = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    status = torch.empty(rows, dtype=torch.int32, device=device)
    mask = torch.empty((rows, vocab) if with_mask else (1,), dtype=torch.uint8, device=device)
    if rows:
        _launch(
            sample_kernel,
            (rows,),
            logits,
            logits.stride(0),
            vocab,
            inv_temperature.to(torch.float32).contiguous(),
            top_k.to(torch.int64).contiguous(),
            top_p.to(torch.float32).contiguous(),
            min_p.to(torch.float32).contiguous(),
            keys.to(torch.int64).contiguous(),
            tokens,
            status,
            mask,
            WRITE_MASK=with_mask,
            BLOCK=min(block, max(16, 1 << (vocab - 1).bit_length())),
            enable_fp_fusion=False,  # every float op rounds alone, as the torch specification's do
        )
    return tokens, status, mask.bool() if with_mask else None
