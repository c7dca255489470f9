"""The decode-step seam of the Llama family: a step of a few decode rows runs every decoder layer as one native
call (`pagoda.pagedkernel.decode`), bitwise what the torch modules compute on the `cpu` kernels.

`NativeDecode` is the model's policy object: `run(...)` either runs the layers natively and says so, or says no
and the model runs its modules. It says no for what the C layers do not do (checked once per model, then per step):
prefill or mixed steps, more than `max_rows` rows, LoRA, tensor parallelism, images' own rotary angles, several KV
cache groups, int8 or fp8 KV caches, dense (unquantized) or unsupported GGUF weights, biases, q/k norms, an
attention backend other than `cpu`, and dtypes other than float32 and bfloat16.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
from pagoda.pagedkernel import decode
from pagoda.server.models.attention import AttentionMetadata, LayerKVCache
from pagoda.server.models.layers import Linear
from torch import Tensor

if TYPE_CHECKING:
    from pagoda.server.models.llama import LlamaDecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)

# Rows up to which a decode step runs natively: beyond a few rows the per-op overhead is a small share of the
# step, and the many-row kernels (AMX, oneDNN) of the module path win.
DEFAULT_MAX_ROWS = 4


class NativeDecode:
    """Whether and how a Llama-family model's decode steps run as one native call (see the module docstring)."""

    def __init__(self, *, enabled: bool = True, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.enabled = enabled
        self.max_rows = min(max_rows, decode.MAX_ROWS)
        # Steps that ran natively (tests and benchmarks read it).
        self.steps = 0
        self._stack: decode.DecodeStack | None = None
        self._refused: str | None = None  # why the model cannot run natively, once known
        self._key: tuple[object, ...] = ()  # `_fingerprint` of what the stack's table points at

    def run(
        self,
        model: LlamaForCausalLM,
        x: Tensor,  # [num_tokens, hidden]: the input embeddings
        cos: Tensor,  # [num_tokens, 1, head_dim // 2]
        sin: Tensor,  # [num_tokens, 1, head_dim // 2]
        kv_caches: Sequence[LayerKVCache],
        attn: AttentionMetadata,
    ) -> Tensor | None:  # [num_tokens, hidden]
        """The last decoder layer's output (every layer run natively), or None when this step or model is one the
        native layers do not run (nothing was written)."""
        if not self.enabled or self._refused is not None or not attn.is_decode:
            return None
        if x.shape[0] > self.max_rows or attn.group_block_tables or attn.backend.name != "cpu":
            return None
        stack = self._stack_for(model, x.dtype, kv_caches)
        if stack is None:
            return None
        out = x.clone(memory_format=torch.contiguous_format)  # the caller's embeddings stay as they were
        half = cos.shape[-1]
        stack.run(
            out,
            cos.reshape(-1, half),
            sin.reshape(-1, half),
            attn.slot_mapping,
            attn.block_tables,
            attn.context_lens,
        )
        self.steps += 1
        return out

    def _stack_for(
        self, model: LlamaForCausalLM, dtype: torch.dtype, kv_caches: Sequence[LayerKVCache]
    ) -> decode.DecodeStack | None:
        """The model's stack, built again whenever anything its table points at moved (sleep mode swaps weight
        storages under the same tensors) or a LoRA hook came or went; None: refused."""
        key = _fingerprint(model, kv_caches)
        stack = self._stack
        if stack is not None and stack.dtype == dtype and key == self._key:
            return stack
        self._stack = None
        reason = refusal(model, dtype, kv_caches)
        if reason is not None:
            if reason.permanent:
                self._refused = reason.text
            logger.info("decode steps run the torch layers: %s", reason.text)
            return None
        self._stack = build_stack(model, dtype, kv_caches)
        self._key = key
        return self._stack


class Refusal:
    """Why a model cannot run natively; `permanent` when no later step can change it (its weights, its config)."""

    def __init__(self, text: str, *, permanent: bool) -> None:
        self.text = text
        self.permanent = permanent


def _layers(model: LlamaForCausalLM) -> list[LlamaDecoderLayer]:
    """The model's decoder layers (a ModuleList types its items as plain modules)."""
    return cast("list[LlamaDecoderLayer]", list(model.model.layers))


def _linears(model: LlamaForCausalLM) -> list[Linear]:
    """Every projection of every layer, in layer order."""
    out: list[Linear] = []
    for layer in _layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        out += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return out


def _fingerprint(model: LlamaForCausalLM, kv_caches: Sequence[LayerKVCache]) -> tuple[object, ...]:
    """Every address the stack's table holds (norms, weight blocks, caches) and every projection's quantized weight
    and LoRA hook (by identity): equal keys, the same table (about 30 us a step for a 30-layer model)."""
    key: list[object] = [len(kv_caches)]
    for layer in _layers(model):
        key += [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()]
    for linear in _linears(model):
        key += [id(linear.quantized), id(linear.lora)]  # identities (their == would compare tensors)
        if linear.quantized is not None:
            key += [part.data.data_ptr() for part in linear.quantized.parts]
    for cache in kv_caches:
        key += [cache.k.data_ptr(), cache.v.data_ptr()]
    return tuple(key)


def refusal(model: LlamaForCausalLM, dtype: torch.dtype, kv_caches: Sequence[LayerKVCache]) -> Refusal | None:
    """None when the model's layers can run natively in `dtype` over these caches, else why not."""
    if model.group.size != 1:
        return Refusal("tensor parallelism", permanent=True)
    if dtype not in decode.DTYPES:
        return Refusal(f"dtype {dtype}", permanent=True)
    if not decode.available(dtype):
        return Refusal("the native decode library does not build here", permanent=True)
    for layer in _layers(model):
        attn = layer.self_attn
        if attn.q_norm is not None or attn.k_norm is not None:
            return Refusal("q/k norms", permanent=True)
        if attn.attn.logit_softcap is not None:
            return Refusal("attention logit softcapping", permanent=True)
    for linear in _linears(model):
        if linear.bias is not None:
            return Refusal("projection biases", permanent=True)
        if linear.quantized is None:
            return Refusal("dense (unquantized) weights", permanent=True)
        if not decode.supports_weight(linear.quantized.parts):
            formats = "+".join(p.qtype.name for p in linear.quantized.parts)
            return Refusal(f"weight formats {formats}", permanent=True)
        if linear.lora is not None:
            return Refusal("LoRA adapters", permanent=False)
    if len(kv_caches) != len(model.model.layers):
        return Refusal("a KV cache per layer is missing", permanent=False)
    for cache in kv_caches:
        if cache.k_scale is not None or cache.k.dtype != dtype or cache.v.dtype != dtype:
            return Refusal(f"a {cache.k.dtype} KV cache", permanent=False)
        if not (cache.k.is_contiguous() and cache.v.is_contiguous()) or cache.k.device.type != "cpu":
            return Refusal("a KV cache that is not contiguous CPU memory", permanent=False)
    return None


def build_stack(
    model: LlamaForCausalLM, dtype: torch.dtype, kv_caches: Sequence[LayerKVCache]
) -> decode.DecodeStack:
    """The model's layers described for the native call (after `refusal` said yes)."""
    layers: list[decode.DecodeLayer] = []
    first = _layers(model)[0]
    for layer, cache in zip(_layers(model), kv_caches, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        parts = [
            lin.quantized.parts
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if lin.quantized is not None
        ]
        layers.append(
            decode.DecodeLayer(
                input_norm=layer.input_layernorm.weight.data,
                post_norm=layer.post_attention_layernorm.weight.data,
                qkv=parts[0],
                o=parts[1],
                gate_up=parts[2],
                down=parts[3],
                k_cache=cache.k,
                v_cache=cache.v,
                sliding_window=attn.attn.sliding_window,
            )
        )
    attention = first.self_attn
    shape = decode.DecodeShape(
        hidden=int(first.input_layernorm.weight.shape[0]),
        num_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        inner=int(first.mlp.down_proj.weight_shape()[1]),
        eps=float(first.input_layernorm.eps),
        scale=float(attention.attn.scale),
    )
    return decode.DecodeStack(layers, shape, dtype)
