"""Fused layer ops: RMSNorm, rotary embeddings and gated activations as single ops, chained as decoder layers
chain them.

`rms_norm(x, weight, eps, unit_offset=...)` normalises the last dimension (Gemma's `x_hat * (1 + w)` or Llama's
`w * x_hat`, each rounded where Hugging Face's modules round); `add_rms_norm(x, residual, ...)` adds a branch to
the residual stream (optionally normalising the branch first, Gemma's sandwich) and normalises the sum;
`rotary(x, cos, sin, norm_weight=...)` applies the half-split rotary embedding, after a per-head norm when
given (the q/k norms of Gemma 3 and Qwen 3); `act_and_mul(x, "gelu_tanh" | "silu")` is a gated MLP's
activation times its up projection. Backends: `torch` (the specification, `torch_fused`) and `cpu`
(csrc/cpu_fused.c, built by `cbuild`); `auto` picks `cpu` for CPU tensors when a C compiler builds it, else
`torch` (CUDA runs the torch ops).
"""

from pagoda.pagedkernel.fused.ops import (
    ACTIVATIONS,
    FUSED_BACKENDS,
    ActivationName,
    FusedBackendName,
    act_and_mul,
    add_rms_norm,
    rms_norm,
    rotary,
)

__all__ = [
    "ACTIVATIONS",
    "FUSED_BACKENDS",
    "ActivationName",
    "FusedBackendName",
    "act_and_mul",
    "add_rms_norm",
    "rms_norm",
    "rotary",
]
