"""The fused ops in torch: the specification the C kernels reproduce (Hugging Face's order of operations)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(
    x: Tensor,  # [..., dim]
    weight: Tensor,  # [dim], x's dtype
    eps: float,
    unit_offset: bool,
) -> Tensor:  # [..., dim], x's dtype
    """x / rms(x) in float32, then Gemma's `* (1 + w)` in float32 (rounded once) or Llama's cast then `w *`."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: Tensor,  # [rows, dim]: the branch's output
    residual: Tensor,  # [rows, dim], x's dtype
    weight: Tensor,  # [dim]
    eps: float,
    unit_offset: bool,
    pre_weight: Tensor | None,  # [dim]: normalise the branch first (Gemma's post-attention norm), or None
) -> tuple[Tensor, Tensor]:  # (residual + branch, rms_norm of it), each [rows, dim]
    """The residual stream after a branch, and its norm for the next branch."""
    branch = x if pre_weight is None else rms_norm(x, pre_weight, eps, unit_offset)
    total = residual + branch
    return total, rms_norm(total, weight, eps, unit_offset)


def rotary(
    x: Tensor,  # [num_tokens, num_heads, head_dim]
    cos: Tensor,  # [num_tokens, 1, head_dim // 2], x's dtype
    sin: Tensor,  # [num_tokens, 1, head_dim // 2], x's dtype
    norm_weight: Tensor | None,  # [head_dim]: a per-head RMSNorm first, or None
    eps: float,
    unit_offset: bool,
) -> Tensor:  # [num_tokens, num_heads, head_dim]
    """Rotate each (x[i], x[i + head_dim / 2]) pair by its position's angle, in x's dtype."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps, unit_offset)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def act_and_mul(
    x: Tensor,  # [rows, 2 * inner]: the gate and up projections side by side
    activation: str,  # "gelu_tanh" or "silu"
) -> Tensor:  # [rows, inner], x's dtype
    """act(gate) * up, each op in x's dtype (as Gemma's GeGLU and Llama's SwiGLU MLPs compute it)."""
    gate, up = x.chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)
    out: Tensor = act * up
    return out
