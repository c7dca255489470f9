"""The `cpu` backend of the LoRA ops: csrc/cpu_lora.c, compiled per dtype at first use by `cbuild`, loaded with
ctypes (which releases the GIL during the call)."""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pagoda.pagedkernel import cbuild, csrc
from pagoda.pagedkernel.backend import BackendUnavailableError
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE_FILE = "cpu_lora.c"
CFLAGS = ("-O3", "-march=native", "-fno-math-errno")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class LoRAKernels:
    """The two entry points of one dtype's library (see the C file for their contracts)."""

    shrink: Any  # ctypes: (x, x_stride, a, slots, scales, rows, rank, k, num_slots, h, threads) -> int
    # ctypes: (h, b, slots, rows, n, rank, num_slots, y, y_stride, offset, threads, b_stride_n, b_stride_r) -> int
    expand: Any
    embedding_shrink: Any  # ctypes: (ids, a, slots, scales, rows, rank, vocab, num_slots, h) -> int
    # ctypes: (x, x_stride, a, slots, rows, in, rank, shards, b_ptrs, sizes, offsets, used, num_slots, y,
    # y_stride, threads) -> int (fused.LoRALayer)
    apply: Any


OWNER = "the 'cpu' LoRA ops"


def build(dtype: torch.dtype) -> Path:
    """The library for `dtype`, compiled unless cached (BackendUnavailableError without a working compiler)."""
    return csrc.build_for_dtype(SOURCE_FILE, dtype, CFLAGS, owner=OWNER, instead="use backend='torch'")


@functools.cache
def kernels(dtype: torch.dtype) -> LoRAKernels:
    """This CPU's library for `dtype`, built or found in the cache and loaded once per process (a damaged one is
    compiled again: `cbuild.load_or_rebuild`).

    Raises BackendUnavailableError (with the compiler's output) when there is no compiler or it fails.
    """
    return cbuild.load_or_rebuild(lambda: build(dtype), load, owner=OWNER)


def load(library: Path) -> LoRAKernels:
    """The entry points of a library that `build` made, with their C signatures declared."""
    lib = ctypes.CDLL(str(library))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    shrink = lib["pagoda_lora_shrink"]
    shrink.argtypes, shrink.restype = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64], ctypes.c_int
    expand = lib["pagoda_lora_expand"]
    expand.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, i64, i64, i64, i64]
    expand.restype = ctypes.c_int
    gather = lib["pagoda_lora_embedding_shrink"]
    gather.argtypes, gather.restype = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr], ctypes.c_int
    apply = lib["pagoda_lora_apply"]
    apply.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, i64]
    apply.restype = ctypes.c_int
    return LoRAKernels(shrink, expand, gather, apply)


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Whether `dtype`'s library builds and loads (once per process; `auto` falls back to torch without it)."""
    try:
        kernels(dtype)
    except (BackendUnavailableError, OSError) as exc:
        logger.warning("the LoRA ops fall back to torch: %s", exc)
        return False
    return True


def _check(code: int, num_slots: int) -> None:
    """Turn the C kernel's status into an exception."""
    if code == 1:
        raise IndexError(f"a LoRA slot index is out of range (the pool has {num_slots} slots)")
    if code == 3:
        raise ValueError("the 'cpu' LoRA expand takes B output-major or rank-major (ops.expand_layout)")
    if code == 2:
        raise IndexError("a token id of a row with a LoRA adapter is outside the embedding's vocabulary")
    if code != 0:
        raise ValueError(f"the 'cpu' LoRA op refused its arguments (status {code})")


def lora_shrink(
    x: Tensor,  # [num_tokens, in_features], rows contiguous
    a: Tensor,  # [num_slots, rank, in_features], contiguous, x's dtype
    slots: Tensor,  # int64 [num_tokens], contiguous
    scales: Tensor,  # float32 [num_slots], contiguous
) -> Tensor:  # float32 [num_tokens, rank]
    """See `torch_lora.lora_shrink`."""
    lib = kernels(x.dtype)
    h = torch.empty((x.shape[0], a.shape[1]), dtype=torch.float32)
    code = lib.shrink(
        x.data_ptr(),
        x.stride(0),
        a.data_ptr(),
        slots.data_ptr(),
        scales.data_ptr(),
        x.shape[0],
        a.shape[1],
        a.shape[2],
        a.shape[0],
        h.data_ptr(),
        torch.get_num_threads(),
    )
    _check(code, a.shape[0])
    return h


def lora_expand(
    h: Tensor,  # float32 [num_tokens, rank], contiguous
    b: Tensor,  # [num_slots, out_features, rank], y's dtype: contiguous, or a transposed [slots, rank, out] one
    slots: Tensor,  # int64 [num_tokens], contiguous
    y: Tensor,  # [num_tokens, >= offset + out_features], rows contiguous
    offset: int,
) -> None:
    """See `torch_lora.lora_expand` (a rank-major B, `ops.expand_layout`, takes the vectorized path)."""
    lib = kernels(y.dtype)
    code = lib.expand(
        h.data_ptr(),
        b.data_ptr(),
        slots.data_ptr(),
        y.shape[0],
        b.shape[1],
        b.shape[2],
        b.shape[0],
        y.data_ptr(),
        y.stride(0),
        offset,
        torch.get_num_threads(),
        b.stride(1),
        b.stride(2),
    )
    _check(code, b.shape[0])


def lora_embedding_shrink(
    ids: Tensor,  # int64 [num_tokens], contiguous
    a: Tensor,  # [num_slots, vocab, rank], contiguous (A transposed)
    slots: Tensor,  # int64 [num_tokens], contiguous
    scales: Tensor,  # float32 [num_slots], contiguous
) -> Tensor:  # float32 [num_tokens, rank]
    """See `torch_lora.lora_embedding_shrink`."""
    lib = kernels(a.dtype)
    h = torch.empty((ids.shape[0], a.shape[2]), dtype=torch.float32)
    code = lib.embedding_shrink(
        ids.data_ptr(),
        a.data_ptr(),
        slots.data_ptr(),
        scales.data_ptr(),
        ids.shape[0],
        a.shape[2],
        a.shape[1],
        a.shape[0],
        h.data_ptr(),
    )
    _check(code, a.shape[0])
    return h
