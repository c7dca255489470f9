"""The LoRA ops' public functions: argument checks, then the `torch`, `cpu` or `triton` backend."""

from __future__ import annotations

from typing import Literal

import torch
from pagoda.pagedkernel.backend import BackendUnavailableError, triton_interpreted
from pagoda.pagedkernel.lora import cpu_lora, torch_lora
from torch import Tensor

LoRABackendName = Literal["auto", "torch", "cpu", "triton"]
LORA_BACKENDS: tuple[LoRABackendName, ...] = ("auto", "torch", "cpu", "triton")
# `auto` on the CPU: the C kernel up to this many rows (decode batches: one pass over each row's factors, no
# gather), torch's per-slot matmuls above (prefill chunks), where BLAS outruns row-at-a-time dot products.
CPU_MAX_ROWS = 64


def _resolve(
    backend: LoRABackendName, x: Tensor, *, gather: bool = False
) -> Literal["torch", "cpu", "triton"]:
    """The backend that runs `x`'s batch (raises for a bad name or an unusable explicit backend); a `gather`
    (the embedding's lookup) has no product that BLAS would run faster, so `auto` keeps C at any row count."""
    if backend not in LORA_BACKENDS:
        raise ValueError(f"unknown LoRA backend {backend!r}; one of {', '.join(LORA_BACKENDS)}")
    on_cpu = x.device.type == "cpu"
    if backend == "cpu":
        if not on_cpu:
            raise ValueError(f"the 'cpu' LoRA ops take CPU tensors, x is on {x.device}")
        cpu_lora.kernels(x.dtype)  # raises BackendUnavailableError naming what is missing
        return "cpu"
    if backend == "triton":
        if on_cpu and not triton_interpreted():
            raise BackendUnavailableError(
                "the 'triton' LoRA ops run on CUDA, or on the CPU under TRITON_INTERPRET=1"
            )
        return "triton"
    if backend == "torch":
        return "torch"
    if on_cpu:
        fits = (gather or x.shape[0] <= CPU_MAX_ROWS) and x.dtype in cpu_lora.DTYPES
        return "cpu" if fits and cpu_lora.available(x.dtype) else "torch"
    try:
        import triton  # noqa: F401 (only whether it is installed)
    except ImportError:
        return "torch"
    return "triton"


def _check_slots(slots: Tensor, rows: int, num_slots: int, device: torch.device) -> None:
    """slots must be int64 [rows] on the batch's device; on the CPU also inside the pool (on CUDA reading them
    back would wait for the GPU every layer: the scheduler's slot mapping is trusted there)."""
    if slots.dtype != torch.int64 or slots.shape != (rows,) or slots.device != device:
        raise ValueError(f"slots must be int64 [{rows}] on {device}, got {slots.dtype} {tuple(slots.shape)}")
    if device.type == "cpu" and rows and int(slots.max()) >= num_slots:
        raise IndexError(f"a LoRA slot index is out of range (the pool has {num_slots} slots)")


def lora_shrink(
    x: Tensor,  # [num_tokens, in_features]
    a: Tensor,  # [num_slots, rank, in_features], x's dtype
    slots: Tensor,  # int64 [num_tokens]; negative: no adapter
    scales: Tensor,  # float32 [num_slots]
    *,
    backend: LoRABackendName = "auto",
) -> Tensor:  # float32 [num_tokens, rank]
    """h[t] = scales[s] * x[t] @ a[s]^T for s = slots[t], in float32; rows with a negative slot are 0."""
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_shrink: x {tuple(x.shape)} does not match a of shape {tuple(a.shape)}")
    if a.dtype != x.dtype or a.device != x.device:
        raise ValueError(f"lora_shrink: a is {a.dtype} on {a.device}, x {x.dtype} on {x.device}")
    if scales.shape != (a.shape[0],):
        raise ValueError(f"lora_shrink: scales must be [{a.shape[0]}], got {tuple(scales.shape)}")
    _check_slots(slots, x.shape[0], a.shape[0], x.device)
    chosen = _resolve(backend, x)
    if chosen == "torch":
        return torch_lora.lora_shrink(x, a, slots, scales)
    x = x if x.stride(-1) == 1 else x.contiguous()
    a, scales, slots = a.contiguous(), scales.to(torch.float32).contiguous(), slots.contiguous()
    if chosen == "cpu":
        return cpu_lora.lora_shrink(x, a, slots, scales)
    from pagoda.pagedkernel.lora import triton_lora

    return triton_lora.lora_shrink(x, a, slots, scales)


def expand_layout(b: Tensor) -> Tensor:  # [num_slots, out_features, rank]
    """`b` itself when the kernels take its layout: contiguous (output-major) or a transposed view of a contiguous
    [slots, rank, out] pool (rank-major, which the C kernel vectorizes over outputs); else a contiguous copy."""
    _, out, rank = b.shape
    if b.stride(0) == out * rank and (
        (b.stride(1) == rank and b.stride(2) == 1) or (b.stride(1) == 1 and b.stride(2) == out)
    ):
        return b
    return b.contiguous()


def lora_expand(
    h: Tensor,  # float32 [num_tokens, rank]
    b: Tensor,  # [num_slots, out_features, rank], y's dtype (a transposed [slots, rank, out] pool is fastest)
    slots: Tensor,  # int64 [num_tokens]; negative: no adapter
    y: Tensor,  # [num_tokens, >= offset + out_features], updated in place
    *,
    offset: int = 0,
    backend: LoRABackendName = "auto",
) -> Tensor:  # y
    """y[t, offset:offset + out_features] += h[t] @ b[s]^T for s = slots[t] (float32 sums, rounded once)."""
    if h.dim() != 2 or b.dim() != 3 or b.shape[2] != h.shape[1] or h.dtype != torch.float32:
        raise ValueError(f"lora_expand: h {h.dtype} {tuple(h.shape)} does not match b {tuple(b.shape)}")
    if y.dim() != 2 or y.shape[0] != h.shape[0] or not 0 <= offset <= y.shape[1] - b.shape[1]:
        raise ValueError(f"lora_expand: y {tuple(y.shape)} has no columns {offset}..{offset + b.shape[1]}")
    if b.dtype != y.dtype or b.device != y.device or h.device != y.device:
        raise ValueError(f"lora_expand: b is {b.dtype} on {b.device}, y {y.dtype} on {y.device}")
    _check_slots(slots, y.shape[0], b.shape[0], y.device)
    chosen = _resolve(backend, y)
    if chosen == "torch" or y.stride(-1) != 1:
        torch_lora.lora_expand(h, b, slots, y, offset)
        return y
    h, b, slots = h.contiguous(), expand_layout(b), slots.contiguous()
    if chosen == "cpu":
        cpu_lora.lora_expand(h, b, slots, y, offset)
        return y
    from pagoda.pagedkernel.lora import triton_lora

    triton_lora.lora_expand(h, b, slots, y, offset)
    return y


def lora_embedding_shrink(
    ids: Tensor,  # int64 [num_tokens]
    a: Tensor,  # [num_slots, vocab, rank]: each slot's A transposed (PEFT's lora_embedding_A.T)
    slots: Tensor,  # int64 [num_tokens]; negative: no adapter
    scales: Tensor,  # float32 [num_slots]
    *,
    backend: LoRABackendName = "auto",
) -> Tensor:  # float32 [num_tokens, rank]
    """h[t] = scales[s] * a[s, ids[t]] for s = slots[t], in float32 (an embedding adapter's A is a lookup table);
    rows with a negative slot are 0. `lora_expand` then adds h @ B^T into the looked-up rows."""
    if ids.dim() != 1 or ids.dtype != torch.int64 or a.dim() != 3 or ids.device != a.device:
        raise ValueError(
            f"lora_embedding_shrink: ids {ids.dtype} {tuple(ids.shape)} on {ids.device} do not match "
            f"a {tuple(a.shape)} on {a.device}"
        )
    if scales.shape != (a.shape[0],):
        raise ValueError(f"lora_embedding_shrink: scales must be [{a.shape[0]}], got {tuple(scales.shape)}")
    _check_slots(slots, ids.shape[0], a.shape[0], ids.device)
    if ids.device.type == "cpu" and ids.shape[0]:
        used = ids[slots >= 0]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= a.shape[1]):
            raise IndexError(f"a token id is outside the adapter's vocabulary of {a.shape[1]}")
    chosen = _resolve(backend, a, gather=True)
    if chosen == "torch":
        return torch_lora.lora_embedding_shrink(ids, a, slots, scales)
    ids, a, slots = ids.contiguous(), a.contiguous(), slots.contiguous()
    scales = scales.to(torch.float32).contiguous()
    if chosen == "cpu":
        return cpu_lora.lora_embedding_shrink(ids, a, slots, scales)
    from pagoda.pagedkernel.lora import triton_lora

    return triton_lora.lora_embedding_shrink(ids, a, slots, scales)


def add_lora(
    y: Tensor,  # [num_tokens, >= offset + out_features], updated in place
    x: Tensor,  # [num_tokens, in_features]
    a: Tensor,  # [num_slots, rank, in_features]
    b: Tensor,  # [num_slots, out_features, rank]
    slots: Tensor,  # int64 [num_tokens]; negative: no adapter
    scales: Tensor,  # float32 [num_slots]
    *,
    offset: int = 0,
    backend: LoRABackendName = "auto",
) -> Tensor:  # y
    """y[t, offset:...] += scales[s] * (x[t] @ a[s]^T) @ b[s]^T: `lora_shrink` then `lora_expand`."""
    h = lora_shrink(x, a, slots, scales, backend=backend)
    return lora_expand(h, b, slots, y, offset=offset, backend=backend)
