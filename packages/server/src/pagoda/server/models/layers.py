"""Building blocks shared by the models: uninitialised linear layers, RMSNorm and rotary embeddings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from pagoda.pagedkernel import fused
from pagoda.server.models.quantized import QuantizedWeight, placeholder
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Rope types whose frequencies depend on the running sequence length: a paged batch mixes lengths, so they are refused.
_DYNAMIC_ROPE_TYPES = frozenset({"dynamic", "longrope"})

# oneDNN's linear, the op torch's own compiler emits for CPU linears; absent from builds without MKL-DNN.
_ONEDNN = bool(torch._C._has_mkldnn) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_ONEDNN_PACK = _ONEDNN and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable_dtypes() -> frozenset[torch.dtype]:
    """The weight dtypes `pack_weight` reorders here: float32, and bfloat16 where oneDNN runs it natively."""
    if not _ONEDNN_PACK:
        return frozenset()
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return frozenset({torch.float32, torch.bfloat16} if bf16 else {torch.float32})


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T (+ b); float32 on the CPU through oneDNN rather than MKL's sgemm, which F.linear calls there.

    Measured on a 2-core AMD EPYC (AVX2): 1.5-2.5x MKL for decode-sized batches (110 x 640 x 4096: 114 vs 72
    GFLOP/s; the LM head, 110 x 640 x 262144: 95 vs 48), on par for prefill-sized ones. Other dtypes and devices
    already reach oneDNN or cuBLAS through F.linear. `weight` may be one that `pack_weight` reordered.
    """
    # x: [..., in_features], weight: [out_features, in_features] -> [..., out_features]
    if weight.is_mkldnn or (_ONEDNN and x.dtype == torch.float32 and x.device.type == "cpu"):
        out: Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out
    return F.linear(x, weight, bias)


def pack_weight(weight: Tensor, batch_size: int) -> Tensor | None:
    """`weight` reordered once into oneDNN's blocked layout for batches of about `batch_size` rows, or None where
    that does not apply (a dtype outside `packable_dtypes`, not on the CPU, no oneDNN).

    Unpacked, oneDNN reorders the weight on every call: for the default model's LM head (671 MB) that is a
    read and a write of the whole matrix per step. Measured on the AMD EPYC at 110 rows (float32): the LM head
    404 -> 374 ms, the 18 layers' projections 246 -> 192 ms a step. In bfloat16 on a Sapphire Rapids Xeon (AMX):
    the LM head 20.3 -> 15.8 ms at one row, a 2048-row qkv 1.76 -> 1.69 ms, a 256-row one 0.61 -> 0.52 ms. The
    products equal the unpacked call's up to float32 rounding (bitwise at decode sizes, and in bfloat16 at every
    size measured; a one-row float32 batch may sum in another order). The result only works with `linear`.
    """
    if weight.dtype not in packable_dtypes() or weight.device.type != "cpu" or weight.is_mkldnn:
        return None
    packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size)
    return packed


def _empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """Uninitialised storage: the loader fills every parameter, so an initialisation pass would be wasted time."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class QuantizableWeight(nn.Module):
    """A module whose `weight` the loader may replace by GGUF blocks (`quantized`; `weight` is then empty)."""

    weight: nn.Parameter
    quantized: QuantizedWeight | None = None

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Hold `weight` instead of the dense matrix, which is freed (its shape must be the dense one's)."""
        want = (self.quantized_rows(), int(self.weight.shape[1]))
        if weight.shape != want:
            raise ValueError(f"quantized weight {weight.shape} != layer weight {want}")
        self.quantized = weight
        self.weight = placeholder(self.weight.dtype, self.weight.device)

    def quantized_rows(self) -> int:
        """Rows a quantized weight has: the dense weight's (a padded vocabulary run holds its real rows only)."""
        return int(self.weight.shape[0])

    def weight_shape(self) -> tuple[int, int]:
        """[rows, columns] of the weight, dense or quantized."""
        if self.quantized is not None:
            return self.quantized.shape
        return int(self.weight.shape[0]), int(self.weight.shape[1])


class OutputHook(Protocol):
    """Adds to a Linear's output in place (a LoRA adapter's delta: `pagoda.server.lora.layers.LoRAHook`)."""

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:  # x [..., in_features], y [..., out_features] -> y
        """y plus the hook's term of x."""
        ...


class Linear(QuantizableWeight):
    """y = x W^T (+ b), with the weight laid out [out_features, in_features] like checkpoints store it."""

    # Set on the adaptable projections when LoRA is enabled; added before a row-parallel all-reduce, so each
    # rank's partial delta (its columns of A) is summed with its partial product.
    lora: OutputHook | None = None

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = _empty_parameter(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty_parameter(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: Tensor) -> Tensor:  # [..., in_features] -> [..., out_features]
        """The affine map."""
        return self.matmul(x, self.bias)

    def matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:  # [..., in_features] -> [..., out_features]
        """x W^T (+ bias) through the dense or the quantized weight."""
        if self.quantized is None:
            y = linear(x, self.weight, bias)
        else:
            y = self.quantized.matmul(x)
            y = y if bias is None else y + bias
        return y if self.lora is None else self.lora(x, y)

    def pack(self, batch_size: int) -> bool:
        """Replace the weight by its `pack_weight` form (the plain one is freed); whether it was packed."""
        if self.quantized is not None:
            return False
        packed = pack_weight(self.weight, batch_size)
        if packed is None:
            return False
        self.weight = nn.Parameter(packed, requires_grad=False)
        return True

    def extra_repr(self) -> str:
        """Shown by print(model)."""
        out_features, in_features = self.weight_shape()
        quantized = (
            ""
            if self.quantized is None
            else ", quantized=" + "+".join(p.qtype.name for p in self.quantized.parts)
        )
        return (
            f"in_features={in_features}, out_features={out_features}, bias={self.bias is not None}{quantized}"
        )


class MergedLinear(Linear):
    """A linear layer whose output rows stack several checkpoint projections (e.g. q, k, v), one matmul for all."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: Sequence[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias, dtype=dtype, device=device)
        self.shard_sizes = tuple(shard_sizes)

    def shard_rows(self, index: int) -> tuple[int, int]:
        """(first row, number of rows) of shard `index` in the weight and bias."""
        return sum(self.shard_sizes[:index]), self.shard_sizes[index]


class Embedding(QuantizableWeight):
    """Token embedding table [num_embeddings, dim] (also the LM head when embeddings are tied)."""

    # Set when LoRA is enabled: called with the (this rank's, negative outside its run) ids and the looked-up rows.
    lora: OutputHook | None = None

    def __init__(self, num_embeddings: int, dim: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty_parameter(num_embeddings, dim, dtype=dtype, device=device)

    def forward(self, ids: Tensor) -> Tensor:  # int64 [num_tokens] -> [num_tokens, dim]
        """The rows of `ids` (plus each row's embedding adapter delta, with LoRA)."""
        rows = self.lookup(ids)
        return rows if self.lora is None else self.lora(ids, rows)

    def lookup(self, ids: Tensor) -> Tensor:  # int64 [num_tokens] (valid rows) -> [num_tokens, dim]
        """Rows of the dense table, or only those rows dequantized from the quantized one."""
        if self.quantized is None:
            return F.embedding(ids, self.weight)
        return self.quantized.rows(ids, self.weight.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32.

    `unit_offset` selects Gemma's form, `x_hat * (1 + w)` in float32 then cast; otherwise Llama's form, the cast
    `x_hat` times `w`: the order of operations of each Hugging Face implementation, which matters in bfloat16.
    """

    def __init__(
        self, dim: int, eps: float, *, unit_offset: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = _empty_parameter(dim, dtype=dtype, device=device)
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: Tensor) -> Tensor:  # [..., dim] -> [..., dim]
        """Normalise `x` by its root mean square and scale it (one fused op: pagoda.pagedkernel.fused)."""
        return fused.rms_norm(x, self.weight, self.eps, unit_offset=self.unit_offset)

    def add(
        self,
        branch: Tensor,  # [num_tokens, dim]: a block's attention or MLP output
        residual: Tensor,  # [num_tokens, dim]
        pre: RMSNorm | None = None,  # the branch's own norm first (Gemma's sandwich), or None
    ) -> tuple[Tensor, Tensor]:  # (residual + branch, this norm of it)
        """The residual stream after a branch, and its norm by this module, in one pass."""
        return fused.add_rms_norm(
            branch,
            residual,
            self.weight,
            self.eps,
            unit_offset=self.unit_offset,
            pre_weight=None if pre is None else pre.weight,
        )

    def extra_repr(self) -> str:
        """Shown by print(model)."""
        return f"{self.weight.shape[0]}, eps={self.eps}, unit_offset={self.unit_offset}"


def head_dim_of(config: PretrainedConfig) -> int:
    """The attention head size: `head_dim` when the config sets it, else hidden_size / num_attention_heads."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else int(config.hidden_size) // int(config.num_attention_heads)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the half-split "rotate_half" form of Hugging Face checkpoints)."""

    def __init__(self, config: PretrainedConfig, layer_type: str | None, device: torch.device) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(config, layer_type, device)
        self.inv_freq: Tensor  # float32 [head_dim // 2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self,
        positions: Tensor,  # int64 [num_tokens]
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]:  # cos, sin: [num_tokens, 1, head_dim // 2] each
        """cos and sin of every token's angles, computed in float32 then cast like Hugging Face does."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        cos = freqs.cos()
        sin = freqs.sin()
        if self.attention_scaling != 1.0:
            cos = cos * self.attention_scaling
            sin = sin * self.attention_scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(
    x: Tensor,  # [num_tokens, num_heads, head_dim]
    cos: Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: Tensor,  # [num_tokens, 1, head_dim // 2]
    norm: RMSNorm | None = None,  # a per-head norm first (the q/k norms of Gemma 3 and Qwen 3), or None
) -> Tensor:  # [num_tokens, num_heads, head_dim]
    """Rotate each (x[i], x[i + head_dim / 2]) pair by its position's angle, after `norm` when given."""
    if norm is None:
        return fused.rotary(x, cos, sin)
    return fused.rotary(x, cos, sin, norm_weight=norm.weight, eps=norm.eps, unit_offset=norm.unit_offset)


def rope_inv_freq(
    config: PretrainedConfig, layer_type: str | None, device: torch.device
) -> tuple[Tensor, float]:
    """Inverse frequencies (float32 [head_dim // 2]) and cos/sin scaling of a config's rope (per layer type)."""
    params: dict[str, Any] = dict(config.rope_parameters or {})
    nested = layer_type is not None and isinstance(params.get(layer_type), dict)
    if nested:
        params = dict(params[str(layer_type)])
    rope_type = str(params.get("rope_type", "default"))
    head_dim = head_dim_of(config)
    if rope_type == "default":
        base = float(params["rope_theta"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        inv_freq = 1.0 / (base**exponents)
        scaling = 1.0
    elif rope_type in _DYNAMIC_ROPE_TYPES:
        raise NotImplementedError(f"rope_type {rope_type!r} (sequence-length dependent) is not supported")
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](
            config, device, layer_type=layer_type if nested else None
        )
    else:
        raise NotImplementedError(f"unknown rope_type {rope_type!r}")
    if inv_freq.shape[0] * 2 != head_dim:
        raise NotImplementedError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    return inv_freq.to(device=device, dtype=torch.float32), float(scaling)


def softcap(x: Tensor, cap: float) -> Tensor:
    """cap * tanh(x / cap), Gemma's smooth clamp of logits."""
    return torch.tanh(x / cap) * cap
