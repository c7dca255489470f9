"""The `cpu` backend of the fused ops: csrc/cpu_fused.c, compiled per dtype at first use by `cbuild`, loaded with
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

SOURCE_FILE = "cpu_fused.c"
# No contraction into FMAs: every product and sum rounds where the torch specification rounds.
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class FusedKernels:
    """The entry points of one dtype's library (see the C file for their contracts)."""

    norm_rotary: (
        Any  # ctypes: (x, tokens, heads, stride_t, stride_h, dim, w, eps, unit, c, s, cs_stride, y, thr)
    )
    add_norm: Any  # ctypes: (x, x_stride, r, rows, dim, w_pre, w, eps, unit, sum, y, threads) -> int
    act_and_mul: Any  # ctypes: (x, rows, x_stride, inner, kind, y, threads) -> int


OWNER = "the 'cpu' fused ops"


def build(dtype: torch.dtype, flags: tuple[str, ...] = CFLAGS) -> Path:
    """The library for `dtype`, compiled unless cached (BackendUnavailableError without a working compiler)."""
    return csrc.build_for_dtype(SOURCE_FILE, dtype, flags, owner=OWNER, instead="use backend='torch'")


@functools.cache
def kernels(dtype: torch.dtype) -> FusedKernels:
    """This CPU's library for `dtype`, built or found in the cache and loaded once per process (a damaged one is
    compiled again: `cbuild.load_or_rebuild`).

    Raises BackendUnavailableError (with the compiler's output) when there is no compiler or it fails.
    """
    return cbuild.load_or_rebuild(lambda: build(dtype), load, owner=OWNER)


def load(library: Path) -> FusedKernels:
    """The entry points of a library that `build` made, with their C signatures declared."""
    lib = ctypes.CDLL(str(library))
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    norm_rotary = lib["pagoda_norm_rotary"]
    norm_rotary.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, f32, i32, ptr, ptr, i64, ptr, i64]
    norm_rotary.restype = ctypes.c_int
    add_norm = lib["pagoda_add_norm"]
    add_norm.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, f32, i32, ptr, ptr, i64]
    add_norm.restype = ctypes.c_int
    act_and_mul = lib["pagoda_act_and_mul"]
    act_and_mul.argtypes, act_and_mul.restype = [ptr, i64, i64, i64, i32, ptr, i64], ctypes.c_int
    return FusedKernels(norm_rotary, add_norm, act_and_mul)


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Whether `dtype`'s library builds and loads (once per process; `auto` falls back to torch without it)."""
    try:
        kernels(dtype)
    except (BackendUnavailableError, OSError) as exc:
        logger.warning("the fused ops fall back to torch: %s", exc)
        return False
    return True


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def norm_rotary(
    x: Tensor,  # [num_tokens, num_heads, dim] or [num_tokens, dim], last dim contiguous
    weight: Tensor | None,  # [dim], x's dtype (a parameter: contiguous)
    eps: float,
    unit_offset: bool,
    cos: Tensor | None,  # [num_tokens, dim // 2] rows contiguous, x's dtype
    sin: Tensor | None,  # like cos
) -> Tensor:  # x's shape, contiguous
    """See `torch_fused.rotary` (and `torch_fused.rms_norm` when cos is None)."""
    if x.dim() == 3:
        tokens, heads, dim = x.shape
        stride_h = x.stride(1)
    else:
        (tokens, dim), heads, stride_h = x.shape, 1, 0
    if weight is not None and weight.stride(0) != 1:
        weight = weight.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype)
    code = kernels(x.dtype).norm_rotary(
        x.data_ptr(),
        tokens,
        heads,
        x.stride(0),
        stride_h,
        dim,
        _ptr(weight),
        eps,
        int(unit_offset),
        _ptr(cos),
        _ptr(sin),
        0 if cos is None else cos.stride(0),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if code != 0:
        raise ValueError(f"the 'cpu' rotary op refused its arguments (status {code}: head_dim {dim} is odd)")
    return y


def add_norm(
    x: Tensor,  # [rows, dim], last dim contiguous
    residual: Tensor,  # [rows, dim] contiguous, x's dtype
    weight: Tensor,  # [dim] contiguous
    eps: float,
    unit_offset: bool,
    pre_weight: Tensor | None,  # [dim] contiguous, or None
) -> tuple[Tensor, Tensor]:  # (sum, normed), each [rows, dim] contiguous
    """See `torch_fused.add_rms_norm`."""
    rows, dim = x.shape
    total, normed = torch.empty_like(residual), torch.empty_like(residual)
    kernels(x.dtype).add_norm(
        x.data_ptr(),
        x.stride(0),
        residual.data_ptr(),
        rows,
        dim,
        _ptr(pre_weight),
        weight.data_ptr(),
        eps,
        int(unit_offset),
        total.data_ptr(),
        normed.data_ptr(),
        torch.get_num_threads(),
    )
    return total, normed


ACTIVATION_IDS = {"gelu_tanh": 0, "silu": 1}


def act_and_mul(
    x: Tensor,  # [rows, 2 * inner], last dim contiguous
    activation: str,
) -> Tensor:  # [rows, inner] contiguous
    """See `torch_fused.act_and_mul`."""
    rows, inner = x.shape[0], x.shape[1] // 2
    y = torch.empty((rows, inner), dtype=x.dtype)
    kernels(x.dtype).act_and_mul(
        x.data_ptr(),
        rows,
        x.stride(0),
        inner,
        ACTIVATION_IDS[activation],
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y
