"""Gemma 3 text decoder (Gemma3ForCausalLM, model_type "gemma3_text").

Differences from Llama: embeddings scaled by sqrt(hidden_size) in the embedding dtype, (1 + w) RMSNorms with
extra norms after attention and after the MLP, per-head q/k norms, GELU-tanh MLP, query scale
query_pre_attn_scalar ** -0.5, sliding-window and full-attention layers interleaved per `layer_types` with one rope
theta per layer type, tied embeddings, and optional attention / final logit soft-capping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from pagoda.pagedkernel import fused
from pagoda.server.models.attention import Attention, AttentionMetadata, LayerKVCache
from pagoda.server.models.base import DecoderLM, sharded_kv_spec
from pagoda.server.models.fused_head import FusedHead
from pagoda.server.models.layers import RMSNorm, RotaryEmbedding, apply_rotary, head_dim_of
from pagoda.server.models.native_decode import LayerView, ModelView, NativeDecode
from pagoda.server.models.parallel import ParallelGroup, SingleRank
from pagoda.server.models.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    attention_projections,
)
from torch import Tensor, nn
from transformers import PretrainedConfig


def gemma3_layer_types(config: PretrainedConfig) -> list[str]:
    """Each layer's attention kind: "sliding_attention" or "full_attention"."""
    # Gemma3TextConfig derives layer_types from the older sliding_window_pattern when a config lacks it.
    return [str(kind) for kind in config.layer_types]


class Gemma3Attention(nn.Module):
    """Fused QKV, per-head (1 + w) q/k norms, rope of this layer's type, paged attention, output projection."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_type: str,
        *,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup,
    ) -> None:
        super().__init__()
        eps = float(config.rms_norm_eps)
        bias = bool(getattr(config, "attention_bias", False))
        self.layer_type = layer_type
        self.head_dim = head_dim_of(config)
        self.qkv_proj, self.o_proj = attention_projections(
            config, qkv_bias=bias, o_bias=bias, dtype=dtype, device=device, group=group
        )
        # This rank's heads.
        self.num_heads, self.num_kv_heads = self.qkv_proj.heads.num_heads, self.qkv_proj.heads.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.q_norm = RMSNorm(self.head_dim, eps, unit_offset=True, dtype=dtype, device=device)
        self.k_norm = RMSNorm(self.head_dim, eps, unit_offset=True, dtype=dtype, device=device)
        window = getattr(config, "sliding_window", None)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            float(config.query_pre_attn_scalar) ** -0.5,
            sliding_window=int(window) if layer_type == "sliding_attention" and window is not None else None,
            logit_softcap=getattr(config, "attn_logit_softcapping", None),
        )

    def forward(
        self,
        x: Tensor,  # [num_tokens, hidden]
        cos: Tensor,  # [num_tokens, 1, head_dim // 2]
        sin: Tensor,  # [num_tokens, 1, head_dim // 2]
        kv_cache: LayerKVCache,
        attn: AttentionMetadata,
    ) -> Tensor:  # [num_tokens, hidden]
        """Self-attention of the step's tokens."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # The q/k norms and the rotary embedding in one op each.
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin, self.q_norm)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin, self.k_norm)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out: Tensor = self.o_proj(self.attn(q, k, v, kv_cache, attn))
        return out


class Gemma3MLP(nn.Module):
    """GeGLU feed-forward (tanh-approximated GELU) with fused gate and up projections."""

    def __init__(
        self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device, group: ParallelGroup
    ) -> None:
        super().__init__()
        hidden, inner = int(config.hidden_size), int(config.intermediate_size)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise NotImplementedError(f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inner, inner], bias=False, dtype=dtype, device=device, group=group
        )
        self.down_proj = RowParallelLinear(inner, hidden, bias=False, dtype=dtype, device=device, group=group)

    def forward(self, x: Tensor) -> Tensor:  # [num_tokens, hidden] -> [num_tokens, hidden]
        """down(gelu_tanh(gate(x)) * up(x))."""
        out: Tensor = self.down_proj(fused.act_and_mul(self.gate_up_proj(x), "gelu_tanh"))
        return out


class Gemma3DecoderLayer(nn.Module):
    """Sandwich-norm block: x + norm(attn(norm(x))), then x + norm(mlp(norm(x)))."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_type: str,
        *,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup,
    ) -> None:
        super().__init__()
        hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
        self.layer_type = layer_type
        self.self_attn = Gemma3Attention(config, layer_type, dtype=dtype, device=device, group=group)
        self.mlp = Gemma3MLP(config, dtype=dtype, device=device, group=group)
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=True, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset=True, dtype=dtype, device=device)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True, dtype=dtype, device=device)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True, dtype=dtype, device=device)

    def forward(
        self,
        x: Tensor,  # [num_tokens, hidden]
        cos: Tensor,  # [num_tokens, 1, head_dim // 2]
        sin: Tensor,  # [num_tokens, 1, head_dim // 2]
        kv_cache: LayerKVCache,
        attn: AttentionMetadata,
    ) -> Tensor:  # [num_tokens, hidden]
        """One block over the step's tokens."""
        x, normed = self.attend(x, cos, sin, kv_cache, attn)
        return self.finish(x, self.mlp(normed))

    def attend(
        self,
        x: Tensor,  # [num_tokens, hidden]
        cos: Tensor,  # [num_tokens, 1, head_dim // 2]
        sin: Tensor,  # [num_tokens, 1, head_dim // 2]
        kv_cache: LayerKVCache,
        attn: AttentionMetadata,
    ) -> tuple[Tensor, Tensor]:  # ([num_tokens, hidden] residual, [num_tokens, hidden] the MLP's input)
        """The block up to its MLP: the residual and the MLP's normed input (attention/FFN disaggregation sends
        the latter to the FFN rank)."""
        attn_out: Tensor = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn)
        # x + post_attention_layernorm(attn_out), and pre_feedforward_layernorm of that, in one op.
        residual, normed = self.pre_feedforward_layernorm.add(attn_out, x, pre=self.post_attention_layernorm)
        return residual, normed

    def finish(
        self,
        residual: Tensor,  # [num_tokens, hidden]
        mlp_out: Tensor,  # [num_tokens, hidden]
    ) -> Tensor:  # [num_tokens, hidden]
        """The block's output: the residual plus the normed MLP output (the norm stays with the attention rank)."""
        out: Tensor = residual + self.post_feedforward_layernorm(mlp_out)
        return out


class Gemma3TextModel(nn.Module):
    """Scaled embedding, decoder layers, final norm, and one rotary embedding per layer type."""

    def __init__(
        self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device, group: ParallelGroup
    ) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        layer_types = gemma3_layer_types(config)
        self.embed_tokens = VocabParallelEmbedding(
            int(config.vocab_size), hidden, dtype=dtype, device=device, group=group
        )
        # Rounded to the embedding dtype before the multiply, as Hugging Face does (it matters in bfloat16).
        self.embed_scale = float(torch.tensor(hidden**0.5, dtype=dtype).item())
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, kind, dtype=dtype, device=device, group=group) for kind in layer_types
        )
        self.norm = RMSNorm(hidden, float(config.rms_norm_eps), unit_offset=True, dtype=dtype, device=device)
        self.rotary_emb = nn.ModuleDict(
            {kind: RotaryEmbedding(config, kind, device) for kind in sorted(set(layer_types))}
        )


class Gemma3ForCausalLM(DecoderLM):
    """Gemma 3 text-only causal LM (tied embeddings unless the config says otherwise)."""

    model: Gemma3TextModel

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.group = group or SingleRank()
        if getattr(config, "use_bidirectional_attention", False):
            raise NotImplementedError(
                "Gemma 3 with use_bidirectional_attention (an embedding model) is not supported"
            )
        self.config = config
        self.model = Gemma3TextModel(config, dtype=dtype, device=device, group=self.group)
        self.layer_types = gemma3_layer_types(config)
        self.spec = sharded_kv_spec(config, len(self.layer_types), self.group)
        self.final_logit_softcapping: float | None = getattr(config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head: ParallelLMHead | None = None
        # Decode steps of a few rows run every layer as one native call where it supports the model and step
        # (`native_decode.enabled = False`: always the modules).
        self.native_decode = NativeDecode()
        # A small decode step whose rows only need a token draws them from the LM head in one pass
        # (`fused_head.enabled = False`: always the logits, then the sampler).
        self.fused_head = FusedHead()
        self.native_states = (self.native_decode, self.fused_head)
        if not self.tie_word_embeddings:
            hidden, vocab = int(config.hidden_size), int(config.vocab_size)
            self.lm_head = ParallelLMHead(vocab, hidden, dtype=dtype, device=device, group=self.group)

    def forward(
        self,
        input_ids: Tensor,  # int64 [num_tokens]
        positions: Tensor,  # int64 [num_tokens]
        kv_caches: Sequence[LayerKVCache],  # one per layer
        attn: AttentionMetadata,
    ) -> Tensor:  # [num_tokens, hidden]
        """Final hidden states of the step's tokens."""
        return self.forward_embeds(
            self.model.embed_tokens(input_ids) * self.model.embed_scale, positions, kv_caches, attn
        )

    def forward_embeds(
        self,
        x: Tensor,  # [num_tokens, hidden]: the tokens' input embeddings, already scaled by embed_scale
        positions: Tensor,  # int64 [num_tokens]
        kv_caches: Sequence[LayerKVCache],  # one per layer
        attn: AttentionMetadata,
    ) -> Tensor:  # [num_tokens, hidden]
        """Final hidden states from the input embeddings (a vision-language model's, images merged in unscaled)."""
        rope = {kind: rotary(positions, x.dtype) for kind, rotary in self.model.rotary_emb.items()}
        tables = [rope[kind] for kind in self._rope_kinds()]
        native = self.native_decode.run(self, x, tables, kv_caches, attn, final_norm=self.model.norm)
        if native is not None:
            return native
        for layer, layer_type, kv_cache in zip(self.model.layers, self.layer_types, kv_caches, strict=True):
            cos, sin = rope[layer_type]
            x = layer(x, cos, sin, kv_cache, attn)
        out: Tensor = self.model.norm(x)
        return out

    def layer_inputs(
        self,
        input_ids: Tensor,  # int64 [num_tokens]
        positions: Tensor,  # int64 [num_tokens]
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:  # [num_tokens, hidden], each layer's cos and sin
        """The first layer's input (scaled embeddings) and each layer's rotary angles, by its layer type
        (attention/FFN disaggregation runs the layers one half at a time)."""
        x = self.model.embed_tokens(input_ids) * self.model.embed_scale
        rope = {kind: rotary(positions, x.dtype) for kind, rotary in self.model.rotary_emb.items()}
        return x, [rope[kind] for kind in self.layer_types]

    def _rope_kinds(self) -> list[str]:
        """The layer types in the order of the rotary tables the native layers index."""
        return sorted(self.model.rotary_emb.keys())

    def native_view(self) -> ModelView:
        """The layers' modules for the native decode layers (`NativeDecodable`): sandwich and q/k norms, GELU,
        one rotary table per layer type."""
        layers = cast("list[Gemma3DecoderLayer]", list(self.model.layers))
        kinds = self._rope_kinds()
        first = layers[0]
        return ModelView(
            layers=tuple(
                LayerView(
                    input_norm=layer.input_layernorm,
                    mlp_norm=layer.pre_feedforward_layernorm,
                    qkv=layer.self_attn.qkv_proj,
                    o=layer.self_attn.o_proj,
                    gate_up=layer.mlp.gate_up_proj,
                    down=layer.mlp.down_proj,
                    attention=layer.self_attn.attn,
                    attn_out_norm=layer.post_attention_layernorm,
                    mlp_out_norm=layer.post_feedforward_layernorm,
                    q_norm=layer.self_attn.q_norm,
                    k_norm=layer.self_attn.k_norm,
                    rope=kinds.index(layer.layer_type),
                )
                for layer in layers
            ),
            group=self.group,
            unit_offset=True,
            activation="gelu_tanh",
            head_dim=first.self_attn.head_dim,
            num_heads=first.self_attn.num_heads,
            num_kv_heads=first.self_attn.num_kv_heads,
            inner=first.mlp.down_proj.weight_shape()[1],
            hidden=int(first.input_layernorm.weight.shape[0]),
        )
