"""The quantized ops' public functions: `dequantize` and `qmatmul`, on the `torch` or `cpu` backend."""

from __future__ import annotations

from typing import Literal

import torch
from pagoda.pagedkernel.quant import cpu_quant, repack, torch_quant
from pagoda.pagedkernel.quant.formats import REPACKED_TYPES, QuantizedTensor
from torch import Tensor

QuantBackendName = Literal["auto", "torch", "cpu"]
QUANT_BACKENDS: tuple[QuantBackendName, ...] = ("auto", "torch", "cpu")
# Activation dtypes qmatmul takes; it returns x's dtype (computed in float32, or bfloat16 tiles for many bfloat16 rows).
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _use_cpu(backend: QuantBackendName, weight: QuantizedTensor) -> bool:
    """Whether `backend` means the C kernels for this weight (raises for a bad name or an unusable 'cpu')."""
    if backend not in QUANT_BACKENDS:
        raise ValueError(f"unknown quantized-op backend {backend!r}; one of {', '.join(QUANT_BACKENDS)}")
    on_cpu = weight.data.device.type == "cpu"
    if backend == "torch":
        return False
    if backend == "cpu":
        if not on_cpu:
            raise ValueError(
                f"the 'cpu' quantized ops take CPU tensors, the weight is on {weight.data.device}"
            )
        cpu_quant.kernels()  # raises BackendUnavailableError naming what is missing
        return True
    return on_cpu and cpu_quant.available()


def dequantize(
    weight: QuantizedTensor, *, backend: QuantBackendName = "auto"
) -> Tensor:  # float32 weight.shape
    """The float32 values `weight` encodes, bit-exact with gguf's reference on every backend."""
    if _use_cpu(backend, weight):
        return cpu_quant.dequantize(weight, cpu_quant.kernels())
    return torch_quant.dequantize(weight)


def dequantize_ids(
    weight: QuantizedTensor,  # [N, K]
    ids: Tensor,  # int64 [m], each in 0..N-1
    *,
    backend: QuantBackendName = "auto",
) -> Tensor:  # float32 [m, K]
    """Rows `ids` of `weight`, dequantized (an embedding lookup): only those rows are read; the values are
    `dequantize(weight)[ids]` on every backend."""
    if _use_cpu(backend, weight):
        return cpu_quant.dequantize_ids(weight, ids, cpu_quant.kernels())
    return torch_quant.dequantize(repack.take_rows(weight, ids))


def qmatmul(
    x: Tensor,  # [rows, K]
    weight: QuantizedTensor,  # [N, K]
    *,
    backend: QuantBackendName = "auto",
    out: Tensor | None = None,  # [rows, N] of x's dtype
) -> Tensor:  # [rows, N] of x's dtype
    """y = x @ W^T for W stored in a GGUF block format, computed in float32.

    On the `cpu` backend few rows use int8 activations (see the README for the error bound); more rows multiply
    the exact dequantized weights in float32 (in bfloat16, rounded to nearest even, for bfloat16 x: on the AMX
    tile unit from `cpu_quant.AMX_MIN_ROWS` rows where the CPU has one, else by AVX-512 BF16 dot products where it
    has those), and so does the `torch` backend, in float32. A repacked layout (`repack.py`) takes int8 activations
    at any number of rows on the `cpu` backend (its kernel outruns the vector paths), except from
    `cpu_quant.VECTOR_MAX_ROWS` rows of a weight small enough to dequantize whole for torch's matmul (on VNNI
    builds, and for Q6_K_R16: `cpu_quant.int8_at_any_rows`).
    """
    if len(weight.shape) != 2:
        raise ValueError(f"qmatmul takes a 2-D weight [N, K], got shape {weight.shape}")
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"qmatmul: x {tuple(x.shape)} does not match a weight of shape {weight.shape}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"qmatmul takes x of {', '.join(map(str, ACTIVATION_DTYPES))}, got {x.dtype}")
    if x.device != weight.data.device:
        raise ValueError(f"qmatmul: x is on {x.device}, the weight on {weight.data.device}")
    if out is not None and (out.shape != (x.shape[0], n) or out.dtype != x.dtype):
        raise ValueError(
            f"qmatmul: out must be {x.dtype} [{x.shape[0]}, {n}], got {out.dtype} {tuple(out.shape)}"
        )
    if not _use_cpu(backend, weight):
        y = torch_quant.qmatmul(x, weight).to(x.dtype)
        if out is None:
            return y
        return out.copy_(y)
    lib = cpu_quant.kernels()
    y = out if out is not None else torch.empty((x.shape[0], n), dtype=x.dtype)
    rows = x.shape[0]
    # A repacked layout has only its int8 kernel (near the int8 peak, past the vector and AMX paths) and, for a
    # prompt's many rows, the tiled path below.
    int8_only = weight.qtype in REPACKED_TYPES
    if (
        not int8_only
        and rows >= cpu_quant.AMX_MIN_ROWS
        and lib.matmul_amx is not None
        and x.dtype == torch.bfloat16
        and x.stride(-1) == 1
        and y.stride(-1) == 1
    ):
        cpu_quant.amx(x, weight, y, lib)
        return y
    if (
        rows >= cpu_quant.VECTOR_MAX_ROWS
        and n * k <= cpu_quant.WHOLE_ELEMENTS
        and not cpu_quant.int8_at_any_rows(weight.qtype, lib)
    ):  # a repacked one too, whole
        cpu_quant.tiled(x if x.dtype == torch.bfloat16 else x.to(torch.float32), weight, y, lib)
        return y
    # float32 and bfloat16 rows go to the kernels as they are (they widen bfloat16 exactly and round a bfloat16
    # output as torch would): no conversion copies around the matmul.
    run = cpu_quant.gemv if rows <= cpu_quant.GEMV_MAX_ROWS or int8_only else cpu_quant.vector
    xin = x if x.dtype in cpu_quant.GEMV_DTYPES and x.stride(-1) == 1 else x.to(torch.float32).contiguous()
    if y.dtype in cpu_quant.GEMV_DTYPES and y.stride(-1) == 1:
        run(xin, weight, y, lib)
        return y
    result = torch.empty((rows, n), dtype=torch.float32)
    run(xin, weight, result, lib)
    return y.copy_(result)
