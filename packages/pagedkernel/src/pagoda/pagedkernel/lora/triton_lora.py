"""The `triton` backend of the LoRA ops (see triton_lora_kernels): for CUDA, and the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

from typing import Any

import torch
from pagoda.pagedkernel.lora.triton_lora_kernels import embedding_shrink_kernel, expand_kernel, shrink_kernel
from torch import Tensor

BLOCK_K = 64  # input features a shrink program reads at a time
BLOCK_N = 64  # output features per expand program


def _launch(kernel: Any, grid: tuple[int, ...], *args: object, **meta: object) -> None:
    """Launch `kernel` on `grid`; the one place the kernels start."""
    kernel[grid](*args, **meta)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (and >= 16, Triton's smallest useful block)."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def lora_shrink(
    x: Tensor,  # [num_tokens, in_features], rows contiguous
    a: Tensor,  # [num_slots, rank, in_features], contiguous
    slots: Tensor,  # int64 [num_tokens]
    scales: Tensor,  # float32 [num_slots]
) -> Tensor:  # float32 [num_tokens, rank]
    """See `torch_lora.lora_shrink`."""
    rows, rank, k = x.shape[0], a.shape[1], a.shape[2]
    h = torch.zeros((rows, rank), dtype=torch.float32, device=x.device)
    block_r = min(_pow2(rank), 64)
    if rows:
        grid = (rows, -(-rank // block_r))
        _launch(
            shrink_kernel,
            grid,
            x,
            x.stride(0),
            a,
            slots,
            scales,
            h,
            rank,
            k,
            BLOCK_R=block_r,
            BLOCK_K=BLOCK_K,
        )
    return h


def lora_expand(
    h: Tensor,  # float32 [num_tokens, rank], contiguous
    b: Tensor,  # [num_slots, out_features, rank], slots out * rank apart (any order of the other two)
    slots: Tensor,  # int64 [num_tokens]
    y: Tensor,  # [num_tokens, >= offset + out_features], rows contiguous
    offset: int,
) -> None:
    """See `torch_lora.lora_expand`."""
    rows, n, rank = y.shape[0], b.shape[1], b.shape[2]
    if rows:
        grid = (rows, -(-n // BLOCK_N))
        _launch(
            expand_kernel,
            grid,
            h,
            b,
            slots,
            y,
            y.stride(0),
            offset,
            n,
            rank,
            b.stride(1),
            b.stride(2),
            BLOCK_N=BLOCK_N,
            BLOCK_R=_pow2(rank),
        )


def lora_embedding_shrink(
    ids: Tensor,  # int64 [num_tokens], contiguous
    a: Tensor,  # [num_slots, vocab, rank], contiguous
    slots: Tensor,  # int64 [num_tokens]
    scales: Tensor,  # float32 [num_slots]
) -> Tensor:  # float32 [num_tokens, rank]
    """See `torch_lora.lora_embedding_shrink`."""
    rows, vocab, rank = ids.shape[0], a.shape[1], a.shape[2]
    h = torch.zeros((rows, rank), dtype=torch.float32, device=ids.device)
    if rows:
        _launch(embedding_shrink_kernel, (rows,), ids, a, slots, scales, h, rank, vocab, BLOCK_R=_pow2(rank))
    return h
