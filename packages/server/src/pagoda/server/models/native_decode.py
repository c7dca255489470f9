"""The decode-step seam of the Llama family and Gemma 3: a step of up to 64 decode rows runs every decoder layer as one
native call (`pagoda.pagedkernel.decode`), bitwise what the torch modules compute on the `cpu` kernels.

`NativeDecode` is the model's policy object: `run(...)` either runs the layers natively and returns their output,
or returns None and the model runs its modules. A model takes part by describing its layers once
(`NativeDecodable.native_view`: which norms, projections, attention module and rotary table each layer uses).
A step's sequences may each bring several tokens (a speculative step's token and its drafts, a short prompt
chunk): the C layers attend them in the prefill kernel's items. It says no for what the C layers do not do
(checked once per model, then per step): more than `max_rows` rows, LoRA, tensor parallelism, images' own rotary angles, int8 or fp8 KV caches, dense
(unquantized) or unsupported GGUF weights, biases, an attention backend other than `cpu`, and dtypes other than
float32 and bfloat16.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from pagoda.pagedkernel import decode
from pagoda.pagedkernel.fused import ActivationName
from pagoda.pagedkernel.quant import QuantizedTensor, cpu_quant
from pagoda.server.models.attention import Attention, AttentionMetadata, LayerKVCache
from pagoda.server.models.layers import Linear, RMSNorm
from pagoda.server.models.parallel import ParallelGroup
from torch import Tensor

logger = logging.getLogger(__name__)


def default_max_rows() -> int:
    """Rows up to which a step runs natively: every row count the C layers take (they multiply as the module path
    does, the int8 GEMV to 16 rows, past it the vector path or a repacked weight's tiles, without its per-op
    overhead: 32 rows of Gemma 3 270M 18.5 -> 14.1 ms a forward on a 2-core Zen 4), except from the row count at
    which the module path multiplies on the AMX tile unit instead, where the CPU has one (the native layers compute
    what the modules compute, bit for bit)."""
    if cpu_quant.kernels().matmul_amx is not None:
        return min(decode.MAX_ROWS, cpu_quant.AMX_MIN_ROWS - 1)
    return decode.MAX_ROWS


@dataclass(frozen=True, slots=True)
class LayerView:
    """One decoder layer's modules as the native layer uses them (see `decode.DecodeLayer` for the chain)."""

    input_norm: RMSNorm
    mlp_norm: RMSNorm  # the residual's norm before the MLP
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    attention: Attention  # the paged attention module: window, scale, soft-cap, KV cache group
    attn_out_norm: RMSNorm | None = None  # Gemma's post-attention norm of the branch
    mlp_out_norm: RMSNorm | None = None  # Gemma's post-feedforward norm of the branch
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None
    rope: int = 0  # which of the step's rotary tables (the model passes them in this order)

    def linears(self) -> tuple[Linear, Linear, Linear, Linear]:
        """The four projections."""
        return self.qkv, self.o, self.gate_up, self.down

    def norms(self) -> tuple[RMSNorm | None, ...]:
        """Every norm (None where the layer has none)."""
        return self.input_norm, self.mlp_norm, self.attn_out_norm, self.mlp_out_norm, self.q_norm, self.k_norm


@dataclass(frozen=True, slots=True)
class ModelView:
    """A model's decoder layers and what they share."""

    layers: tuple[LayerView, ...]
    group: ParallelGroup
    unit_offset: bool  # Gemma's (1 + w) norms
    activation: ActivationName
    head_dim: int
    num_heads: int  # this rank's
    num_kv_heads: int
    inner: int  # the MLP's intermediate size
    hidden: int


class NativeDecodable(Protocol):
    """A model whose decoder layers can run natively."""

    def native_view(self) -> ModelView:
        """Its layers' modules (called once, when its first decode step arrives)."""
        ...


class NativeDecode:
    """Whether and how a model's decode steps run as one native call (see the module docstring)."""

    def __init__(self, *, enabled: bool = True, max_rows: int | None = None) -> None:
        self.enabled = enabled
        # None: default_max_rows(), decided when the first step asks (it loads the GEMV library)
        self.max_rows = None if max_rows is None else min(max_rows, decode.MAX_ROWS)
        # Steps that ran natively (tests and benchmarks read it).
        self.steps = 0
        self._view: ModelView | None = None
        self._stack: decode.DecodeStack | None = None
        self._refused: str | None = None  # why the model cannot run natively, once known
        # The first K cache's address when the stack was built: a cheap guard that the pool did not move unseen
        # (what moves it, sleep mode, calls `forget`).
        self._kv_key: tuple[int, int] = (0, 0)
        # `_kv_key` of a refusal that may pass later (LoRA hooks, the cache's dtype), kept until `forget`.
        self._declined: tuple[int, int] | None = None

    def run(
        self,
        model: NativeDecodable,
        x: Tensor,  # [num_tokens, hidden]: the input embeddings
        ropes: Sequence[tuple[Tensor, Tensor]],  # per rotary table: cos, sin [num_tokens, 1, head_dim // 2]
        kv_caches: Sequence[LayerKVCache],
        attn: AttentionMetadata,
        final_norm: RMSNorm | None = None,  # the model's norm after its last layer
    ) -> Tensor | None:  # [num_tokens, hidden]
        """The last decoder layer's output (every layer run natively), normed by `final_norm` when given (inside
        the native call where its eps and form are the layers'), or None when this step or model is one the native
        layers do not run (nothing was written)."""
        if not self.enabled or self._refused is not None or attn.backend.name != "cpu":
            return None
        if self.max_rows is not None and x.shape[0] > self.max_rows:
            return None
        if self._view is None:
            self._view = model.native_view()
        stack = self._stack_for(self._view, x.dtype, kv_caches)
        if stack is None:
            return None
        if self.max_rows is None:  # after the stack: its kernels are built, so the GEMV library loads
            self.max_rows = default_max_rows()
        if x.shape[0] > self.max_rows:
            return None
        rows = x.shape[0]
        num_seqs = attn.query_start_loc.numel() - 1
        if attn.group_block_tables:
            slots = torch.stack(list(attn.group_slot_mappings))  # [groups, rows]
            tables = _stacked_tables(attn.group_block_tables)  # [groups, num_seqs, max_blocks]
        else:
            slots, tables = attn.slot_mapping[None], attn.block_tables[None]
        if tables.shape[0] < stack.num_groups:
            return None  # the layers name a group the step has no table for
        out = x.clone(memory_format=torch.contiguous_format)  # the caller's embeddings stay as they were
        if len(ropes) == 1:
            cos, sin = ropes[0]
        else:
            cos, sin = torch.stack([c for c, _ in ropes]), torch.stack([s for _, s in ropes])
        shape = stack.shape
        # The norm inside the native call where it computes what the module does (its eps and form the layers').
        folded = (
            final_norm is not None
            and (final_norm.eps, final_norm.unit_offset) == (shape.eps, shape.unit_offset)
            and final_norm.weight.dtype == x.dtype
            and final_norm.weight.is_contiguous()
        )
        stack.run(
            out,
            cos,
            sin,
            slots[:, :rows],
            tables[:, :num_seqs],
            attn.context_lens[:num_seqs],
            query_start_loc=attn.query_start_loc,
            final_norm=final_norm.weight if folded and final_norm is not None else None,
        )
        self.steps += 1
        return final_norm(out) if final_norm is not None and not folded else out

    def forget(self) -> None:
        """Drop the stack: what its table points at moved (sleep mode woke: new weight storages under the same
        tensors, a new KV pool) or LoRA hooks came; the next step builds it again (or refuses)."""
        self._stack = None
        self._declined = None

    def _stack_for(
        self, view: ModelView, dtype: torch.dtype, kv_caches: Sequence[LayerKVCache]
    ) -> decode.DecodeStack | None:
        """The model's stack (built at the first step, and again after `forget`); None: refused. Checking every
        address the table holds each step cost ~0.6 ms of a 9 ms step (GIL-bound beside the server's thread)."""
        kv_key = (len(kv_caches), kv_caches[0].k.data_ptr() if kv_caches else 0)
        stack = self._stack
        if stack is not None and stack.dtype == dtype and kv_key == self._kv_key:
            return stack
        if kv_key == self._declined:
            return None
        self._stack = None
        reason = refusal(view, dtype, kv_caches)
        if reason is not None:
            if reason.permanent:
                self._refused = reason.text
            else:
                self._declined = kv_key
            logger.info("decode steps run the torch layers: %s", reason.text)
            return None
        self._stack = build_stack(view, dtype, kv_caches)
        self._kv_key = kv_key
        return self._stack


def _stacked_tables(tables: Sequence[Tensor]) -> Tensor:  # int32 [groups, num_seqs, max_blocks]
    """The groups' block tables ([num_seqs, blocks_g] each) padded to one width (entries past a sequence's last
    block are never read)."""
    width = max(int(t.shape[1]) for t in tables)
    if all(int(t.shape[1]) == width for t in tables):
        return torch.stack(list(tables))
    return torch.stack([torch.nn.functional.pad(t, (0, width - int(t.shape[1]))) for t in tables])


class Refusal:
    """Why a model cannot run natively; `permanent` when no later step can change it (its weights, its config)."""

    def __init__(self, text: str, *, permanent: bool) -> None:
        self.text = text
        self.permanent = permanent


def refusal(view: ModelView, dtype: torch.dtype, kv_caches: Sequence[LayerKVCache]) -> Refusal | None:
    """None when the model's layers can run natively in `dtype` over these caches, else why not."""
    if view.group.size != 1:
        return Refusal("tensor parallelism", permanent=True)
    if dtype not in decode.DTYPES:
        return Refusal(f"dtype {dtype}", permanent=True)
    if view.activation not in decode.ACTIVATIONS:
        return Refusal(f"activation {view.activation}", permanent=True)
    if not decode.available(dtype):
        return Refusal("the native decode library does not build here", permanent=True)
    first = view.layers[0]
    for layer in view.layers:
        if layer.attention.scale != first.attention.scale or layer.attention.logit_softcap != (
            first.attention.logit_softcap
        ):
            return Refusal("layers of different attention scales", permanent=True)
        if any(n is not None and n.eps != first.input_norm.eps for n in layer.norms()):
            return Refusal("norms of different eps", permanent=True)
        for linear in layer.linears():
            if linear.bias is not None:
                return Refusal("projection biases", permanent=True)
            if linear.quantized is None:
                return Refusal("dense (unquantized) weights", permanent=True)
            if not decode.supports_weight(linear.quantized.parts):
                formats = "+".join(p.qtype.name for p in linear.quantized.parts)
                return Refusal(f"weight formats {formats}", permanent=True)
            if linear.lora is not None:
                return Refusal("LoRA adapters", permanent=False)
    if len(kv_caches) != len(view.layers):
        return Refusal("a KV cache per layer is missing", permanent=False)
    for cache in kv_caches:
        if cache.k_scale is not None or cache.k.dtype != dtype or cache.v.dtype != dtype:
            return Refusal(f"a {cache.k.dtype} KV cache", permanent=False)
        if not (cache.k.is_contiguous() and cache.v.is_contiguous()) or cache.k.device.type != "cpu":
            return Refusal("a KV cache that is not contiguous CPU memory", permanent=False)
    return None


def _parts(linear: Linear) -> Sequence[QuantizedTensor]:
    """A projection's runs of rows (after `refusal` said it is quantized)."""
    if linear.quantized is None:
        raise ValueError("a dense projection has no runs of rows")
    return linear.quantized.parts


def _weight(norm: RMSNorm | None) -> Tensor | None:
    """A norm's weight, or None."""
    return None if norm is None else norm.weight.data


def build_stack(view: ModelView, dtype: torch.dtype, kv_caches: Sequence[LayerKVCache]) -> decode.DecodeStack:
    """The model's layers described for the native call (after `refusal` said yes)."""
    layers = [
        decode.DecodeLayer(
            input_norm=layer.input_norm.weight.data,
            mlp_norm=layer.mlp_norm.weight.data,
            qkv=_parts(layer.qkv),
            o=_parts(layer.o),
            gate_up=_parts(layer.gate_up),
            down=_parts(layer.down),
            k_cache=cache.k,
            v_cache=cache.v,
            sliding_window=layer.attention.sliding_window,
            attn_out_norm=_weight(layer.attn_out_norm),
            mlp_out_norm=_weight(layer.mlp_out_norm),
            q_norm=_weight(layer.q_norm),
            k_norm=_weight(layer.k_norm),
            rope=layer.rope,
            group=layer.attention.kv_cache_group,
        )
        for layer, cache in zip(view.layers, kv_caches, strict=True)
    ]
    first = view.layers[0]
    shape = decode.DecodeShape(
        hidden=view.hidden,
        num_heads=view.num_heads,
        num_kv_heads=view.num_kv_heads,
        head_dim=view.head_dim,
        inner=view.inner,
        eps=float(first.input_norm.eps),
        scale=float(first.attention.scale),
        unit_offset=view.unit_offset,
        activation=view.activation,
        logit_softcap=first.attention.logit_softcap,
    )
    return decode.DecodeStack(layers, shape, dtype)
