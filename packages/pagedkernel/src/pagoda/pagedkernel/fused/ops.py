"""The fused ops' public functions: argument checks, then the `torch` or `cpu` backend."""

from __future__ import annotations

from typing import Literal

from pagoda.pagedkernel.fused import cpu_fused, torch_fused
from torch import Tensor

FusedBackendName = Literal["auto", "torch", "cpu"]
FUSED_BACKENDS: tuple[FusedBackendName, ...] = ("auto", "torch", "cpu")
ActivationName = Literal["gelu_tanh", "silu"]
ACTIVATIONS: tuple[ActivationName, ...] = ("gelu_tanh", "silu")


def _use_cpu(backend: FusedBackendName, x: Tensor, *others: Tensor | None) -> bool:
    """Whether the C kernel runs this call (raises for a bad name or an unusable explicit `cpu`)."""
    if backend not in FUSED_BACKENDS:
        raise ValueError(f"unknown fused-op backend {backend!r}; one of {', '.join(FUSED_BACKENDS)}")
    if backend == "torch":
        return False
    fits = x.device.type == "cpu" and x.dtype in cpu_fused.DTYPES
    fits = fits and all(t is None or (t.dtype == x.dtype and t.device == x.device) for t in others)
    if backend == "cpu":
        if not fits:
            raise ValueError(f"the 'cpu' fused ops take CPU tensors of one dtype in {cpu_fused.DTYPES}")
        cpu_fused.kernels(x.dtype)  # raises BackendUnavailableError naming what is missing
        return True
    return fits and cpu_fused.available(x.dtype)


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
    backend: FusedBackendName = "auto",
) -> Tensor:  # [..., dim], x's dtype
    """RMSNorm over the last dimension: Gemma's `x_hat * (1 + w)` (unit_offset) or Llama's `w * x_hat`."""
    if x.dim() == 0:
        raise ValueError("rms_norm: x must have at least one dimension")
    _check_weight("rms_norm: weight", weight, x.shape[-1])
    if not _use_cpu(backend, x, weight):
        return torch_fused.rms_norm(x, weight, eps, unit_offset)
    return cpu_fused.norm_rotary(_rows(x), weight, eps, unit_offset, None, None).view(x.shape)


def add_rms_norm(
    x: Tensor,  # [rows, dim]: a branch's output
    residual: Tensor,  # [rows, dim], x's dtype
    weight: Tensor,  # [dim]
    eps: float,
    *,
    unit_offset: bool,
    pre_weight: Tensor | None = None,  # [dim]: the branch's own norm first (Gemma's sandwich), or None
    backend: FusedBackendName = "auto",
) -> tuple[Tensor, Tensor]:  # (residual + branch, its rms_norm), each [rows, dim]
    """The residual stream after a branch and its norm for the next branch, in one pass over the rows."""
    if x.dim() != 2 or residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    _check_weight("add_rms_norm: weight", weight, x.shape[1])
    _check_weight("add_rms_norm: pre_weight", pre_weight, x.shape[1])
    if not _use_cpu(backend, x, residual, weight, pre_weight):
        return torch_fused.add_rms_norm(x, residual, weight, eps, unit_offset, pre_weight)
    x = x if x.stride(-1) == 1 else x.contiguous()
    pre = None if pre_weight is None else pre_weight.contiguous()
    return cpu_fused.add_norm(x, residual.contiguous(), weight.contiguous(), eps, unit_offset, pre)


def rotary(
    x: Tensor,  # [num_tokens, num_heads, head_dim]
    cos: Tensor,  # [num_tokens, 1, head_dim // 2], x's dtype
    sin: Tensor,  # [num_tokens, 1, head_dim // 2], x's dtype
    *,
    norm_weight: Tensor | None = None,  # [head_dim]: a per-head RMSNorm first (q/k norms), or None
    eps: float = 1e-6,
    unit_offset: bool = False,
    backend: FusedBackendName = "auto",
) -> Tensor:  # [num_tokens, num_heads, head_dim]
    """The half-split rotary embedding ("rotate_half"), after a per-head RMSNorm when `norm_weight` is given."""
    if x.dim() != 3 or x.shape[2] % 2:
        raise ValueError(f"rotary: x must be [num_tokens, num_heads, even head_dim], got {tuple(x.shape)}")
    half = (x.shape[0], 1, x.shape[2] // 2)
    if cos.shape != half or sin.shape != half:
        raise ValueError(f"rotary: cos and sin must be {half}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    _check_weight("rotary: norm_weight", norm_weight, x.shape[2])
    if not _use_cpu(backend, x, cos, sin, norm_weight):
        return torch_fused.rotary(x, cos, sin, norm_weight, eps, unit_offset)
    x = x if x.stride(-1) == 1 else x.contiguous()
    c, s = cos.reshape(half[0], half[2]), sin.reshape(half[0], half[2])
    if c.stride() != s.stride() or c.stride(-1) != 1:
        c, s = c.contiguous(), s.contiguous()
    return cpu_fused.norm_rotary(x, norm_weight, eps, unit_offset, c, s)


def act_and_mul(
    x: Tensor,  # [rows, 2 * inner]: the fused gate and up projections' output
    activation: ActivationName,
    *,
    backend: FusedBackendName = "auto",
) -> Tensor:  # [rows, inner]
    """act(gate) * up of a gated MLP (GeGLU with the tanh GELU, or SwiGLU), reading both halves in one pass."""
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"act_and_mul: activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}"
        )
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"act_and_mul: x must be [rows, 2 * inner], got {tuple(x.shape)}")
    if not _use_cpu(backend, x):
        return torch_fused.act_and_mul(x, activation)
    return cpu_fused.act_and_mul(x if x.stride(-1) == 1 else x.contiguous(), activation)
