"""The norm ops' public functions: argument checks, then the `torch` or `cpu` backend."""

from __future__ import annotations

from typing import Literal

from pagoda.pagedkernel.norm import cpu_norm, torch_norm
from torch import Tensor

NormBackendName = Literal["auto", "torch", "cpu"]
NORM_BACKENDS: tuple[NormBackendName, ...] = ("auto", "torch", "cpu")


def _use_cpu(backend: NormBackendName, x: Tensor, *others: Tensor | None) -> bool:
    """Whether the C kernel runs this call (raises for a bad name or an unusable explicit `cpu`)."""
    if backend not in NORM_BACKENDS:
        raise ValueError(f"unknown norm backend {backend!r}; one of {', '.join(NORM_BACKENDS)}")
    if backend == "torch":
        return False
    fits = x.device.type == "cpu" and x.dtype in cpu_norm.DTYPES
    fits = fits and all(t is None or (t.dtype == x.dtype and t.device == x.device) for t in others)
    if backend == "cpu":
        if not fits:
            raise ValueError(f"the 'cpu' norm ops take CPU tensors of one dtype in {cpu_norm.DTYPES}")
        cpu_norm.kernels(x.dtype)  # raises BackendUnavailableError naming what is missing
        return True
    return fits and cpu_norm.available(x.dtype)


def _check_weight(name: str, weight: Tensor | None, dim: int) -> None:
    if weight is not None and weight.shape != (dim,):
        raise ValueError(f"{name} must be [{dim}], got {tuple(weight.shape)}")


def _rows(x: Tensor) -> Tensor:  # [tokens, heads, dim] or [rows, dim], last dim contiguous
    """x as rows the C kernel reads: itself when 2-D or 3-D with contiguous rows, else flattened to 2-D."""
    if x.dim() in (2, 3) and x.stride(-1) == 1:
        return x
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rms_norm(
    x: Tensor,  # [..., dim]
    weight: Tensor,  # [dim], x's dtype
    eps: float,
    *,
    unit_offset: bool,
    backend: NormBackendName = "auto",
) -> Tensor:  # [..., dim], x's dtype
    """RMSNorm over the last dimension: Gemma's `x_hat * (1 + w)` (unit_offset) or Llama's `w * x_hat`."""
    if x.dim() == 0:
        raise ValueError("rms_norm: x must have at least one dimension")
    _check_weight("rms_norm: weight", weight, x.shape[-1])
    if not _use_cpu(backend, x, weight):
        return torch_norm.rms_norm(x, weight, eps, unit_offset)
    return cpu_norm.norm_rotary(_rows(x), weight, eps, unit_offset, None, None).view(x.shape)


def add_rms_norm(
    x: Tensor,  # [rows, dim]: a branch's output
    residual: Tensor,  # [rows, dim], x's dtype
    weight: Tensor,  # [dim]
    eps: float,
    *,
    unit_offset: bool,
    pre_weight: Tensor | None = None,  # [dim]: the branch's own norm first (Gemma's sandwich), or None
    backend: NormBackendName = "auto",
) -> tuple[Tensor, Tensor]:  # (residual + branch, its rms_norm), each [rows, dim]
    """The residual stream after a branch and its norm for the next branch, in one pass over the rows."""
    if x.dim() != 2 or residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    _check_weight("add_rms_norm: weight", weight, x.shape[1])
    _check_weight("add_rms_norm: pre_weight", pre_weight, x.shape[1])
    if not _use_cpu(backend, x, residual, weight, pre_weight):
        return torch_norm.add_rms_norm(x, residual, weight, eps, unit_offset, pre_weight)
    x = x if x.stride(-1) == 1 else x.contiguous()
    pre = None if pre_weight is None else pre_weight.contiguous()
    return cpu_norm.add_norm(x, residual.contiguous(), weight.contiguous(), eps, unit_offset, pre)


def rotary(
    x: Tensor,  # [num_tokens, num_heads, head_dim]
    cos: Tensor,  # [num_tokens, 1, head_dim // 2], x's dtype
    sin: Tensor,  # [num_tokens, 1, head_dim // 2], x's dtype
    *,
    norm_weight: Tensor | None = None,  # [head_dim]: a per-head RMSNorm first (q/k norms), or None
    eps: float = 1e-6,
    unit_offset: bool = False,
    backend: NormBackendName = "auto",
) -> Tensor:  # [num_tokens, num_heads, head_dim]
    """The half-split rotary embedding ("rotate_half"), after a per-head RMSNorm when `norm_weight` is given."""
    if x.dim() != 3 or x.shape[2] % 2:
        raise ValueError(f"rotary: x must be [num_tokens, num_heads, even head_dim], got {tuple(x.shape)}")
    half = (x.shape[0], 1, x.shape[2] // 2)
    if cos.shape != half or sin.shape != half:
        raise ValueError(f"rotary: cos and sin must be {half}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    _check_weight("rotary: norm_weight", norm_weight, x.shape[2])
    if not _use_cpu(backend, x, cos, sin, norm_weight):
        return torch_norm.rotary(x, cos, sin, norm_weight, eps, unit_offset)
    x = x if x.stride(-1) == 1 else x.contiguous()
    c, s = cos.reshape(half[0], half[2]), sin.reshape(half[0], half[2])
    if c.stride() != s.stride() or c.stride(-1) != 1:
        c, s = c.contiguous(), s.contiguous()
    weight = None if norm_weight is None else norm_weight.contiguous()
    return cpu_norm.norm_rotary(x, weight, eps, unit_offset, c, s)
