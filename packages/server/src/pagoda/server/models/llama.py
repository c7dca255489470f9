"""Llama-family decoders: Llama 2/3 (incl. Llama 3 rope scaling), Mistral, Qwen2 and Qwen3.

One implementation with the differences read from the Hugging Face config: Qwen2 adds biases to the QKV
projection, Qwen3 normalises each query/key head (RMSNorm over head_dim) before rope, Mistral applies its
`sliding_window` to every layer, and Qwen2/Qwen3 to the layers that `layer_types` marks "sliding_attention".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, cast

import torch
from pagoda.pagedkernel import fused
from pagoda.server.models.attention import Attention, AttentionMetadata, LayerKVCache
from pagoda.server.models.base import DecoderLM, sharded_kv_spec
from pagoda.server.models.fused_head import FusedHead
from pagoda.server.models.layers import Linear, RMSNorm, RotaryEmbedding, apply_rotary, head_dim_of
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


def layer_sliding_windows(config: PretrainedConfig) -> list[int | None]:
    """Each layer's sliding window (None = full attention)."""
    num_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return [None] * num_layers
    if layer_types is None:  # Mistral: one window for every layer
        return [int(window)] * num_layers
    return [int(window) if kind == "sliding_attention" else None for kind in layer_types]


_QKV_BIAS_TYPES = frozenset({"qwen2", "qwen2_vl_text", "qwen2_5_vl_text"})


class LlamaAttention(nn.Module):
    """Fused QKV projection, optional per-head q/k norm, rope, paged attention and the output projection."""

    def __init__(
        self,
        config: PretrainedConfig,
        sliding_window: int | None,
        *,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        # Qwen2's (and Qwen2-VL's text decoder's) q/k/v projections carry biases.
        qkv_bias = config.model_type in _QKV_BIAS_TYPES or bool(getattr(config, "attention_bias", False))
        o_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj, self.o_proj = attention_projections(
            config, qkv_bias=qkv_bias, o_bias=o_bias, dtype=dtype, device=device, group=group
        )
        # This rank's heads.
        self.num_heads, self.num_kv_heads = self.qkv_proj.heads.num_heads, self.qkv_proj.heads.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.model_type == "qwen3":
            eps = float(config.rms_norm_eps)
            self.q_norm = RMSNorm(self.head_dim, eps, unit_offset=False, dtype=dtype, device=device)
            self.k_norm = RMSNorm(self.head_dim, eps, unit_offset=False, dtype=dtype, device=device)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            sliding_window=sliding_window,
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
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin, self.q_norm)  # with Qwen 3's q/k norms first, in one op
        k = apply_rotary(k, cos, sin, self.k_norm)
        out: Tensor = self.o_proj(self.attn(q, k, v, kv_cache, attn))
        return out


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with the gate and up projections fused into one matmul."""

    def __init__(
        self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device, group: ParallelGroup
    ) -> None:
        super().__init__()
        hidden, inner = int(config.hidden_size), int(config.intermediate_size)
        bias = bool(getattr(config, "mlp_bias", False))
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inner, inner], bias=bias, dtype=dtype, device=device, group=group
        )
        self.down_proj = RowParallelLinear(inner, hidden, bias=bias, dtype=dtype, device=device, group=group)

    def forward(self, x: Tensor) -> Tensor:  # [num_tokens, hidden] -> [num_tokens, hidden]
        """down(silu(gate(x)) * up(x))."""
        out: Tensor = self.down_proj(fused.act_and_mul(self.gate_up_proj(x), "silu"))
        return out


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self,
        config: PretrainedConfig,
        sliding_window: int | None,
        *,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup,
    ) -> None:
        super().__init__()
        eps = float(config.rms_norm_eps)
        hidden = int(config.hidden_size)
        self.self_attn = LlamaAttention(config, sliding_window, dtype=dtype, device=device, group=group)
        self.mlp = LlamaMLP(config, dtype=dtype, device=device, group=group)
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=False, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset=False, dtype=dtype, device=device)

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
        """The block up to its MLP: x + attn(norm(x)) and its norm (attention/FFN disaggregation sends the norm to
        the FFN rank)."""
        attn_out: Tensor = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn)
        residual, normed = self.post_attention_layernorm.add(attn_out, x)  # the sum and its norm, in one op
        return residual, normed

    def finish(
        self,
        residual: Tensor,  # [num_tokens, hidden]
        mlp_out: Tensor,  # [num_tokens, hidden]
    ) -> Tensor:  # [num_tokens, hidden]
        """The block's output from its residual and its MLP's output."""
        return residual + mlp_out


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (the `model.` prefix of checkpoints)."""

    def __init__(
        self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device, group: ParallelGroup
    ) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.embed_tokens = VocabParallelEmbedding(
            int(config.vocab_size), hidden, dtype=dtype, device=device, group=group
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, window, dtype=dtype, device=device, group=group)
            for window in layer_sliding_windows(config)
        )
        self.norm = RMSNorm(hidden, float(config.rms_norm_eps), unit_offset=False, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(config, None, device)


class LlamaForCausalLM(DecoderLM):
    """Llama, Mistral, Qwen2 and Qwen3 causal LMs (see the module docstring for what differs)."""

    model: LlamaModel
    # False for the sequence-classification models, whose checkpoints hold a `score` head instead.
    has_lm_head: ClassVar[bool] = True

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.group = group or SingleRank()
        self.model = LlamaModel(config, dtype=dtype, device=device, group=self.group)
        self.spec = sharded_kv_spec(config, int(config.num_hidden_layers), self.group)
        self.tie_word_embeddings = self.has_lm_head and bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head: ParallelLMHead | None = None
        # Decode steps of a few rows run every layer as one native call where it supports the model and step
        # (`native_decode.enabled = False`: always the modules below).
        self.native_decode = NativeDecode()
        # A small decode step whose rows only need a token draws them from the LM head in one pass
        # (`fused_head.enabled = False`: always the logits, then the sampler).
        self.fused_head = FusedHead()
        self.native_states = (self.native_decode, self.fused_head)
        if self.has_lm_head and not self.tie_word_embeddings:
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
        return self.forward_embeds(self.model.embed_tokens(input_ids), positions, kv_caches, attn)

    def forward_embeds(
        self,
        x: Tensor,  # [num_tokens, hidden]: the tokens' input embeddings
        positions: Tensor,  # int64 [num_tokens]
        kv_caches: Sequence[LayerKVCache],  # one per layer
        attn: AttentionMetadata,
        rope: tuple[Tensor, Tensor]
        | None = None,  # cos, sin [num_tokens, 1, head_dim // 2]; None: from positions
    ) -> Tensor:  # [num_tokens, hidden]
        """Final hidden states from the input embeddings (a vision-language model's, images merged in; its own
        rotary angles where its positions are not 1-D, as Qwen2-VL's M-RoPE)."""
        cos, sin = self.model.rotary_emb(positions, x.dtype) if rope is None else rope
        native = (
            None
            if rope is not None
            else self.native_decode.run(self, x, [(cos, sin)], kv_caches, attn, final_norm=self.model.norm)
        )
        if native is not None:
            return native
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, attn)
        out: Tensor = self.model.norm(x)
        return out

    def layer_inputs(
        self,
        input_ids: Tensor,  # int64 [num_tokens]
        positions: Tensor,  # int64 [num_tokens]
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:  # [num_tokens, hidden], each layer's cos and sin
        """The first layer's input and each layer's rotary angles (attention/FFN disaggregation runs the layers one
        half at a time: `LlamaDecoderLayer.attend`, the MLP elsewhere, `finish`)."""
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(positions, x.dtype)
        return x, [rope] * len(self.model.layers)

    def native_view(self) -> ModelView:
        """The layers' modules for the native decode layers (`NativeDecodable`): one rotary table, Llama's norms."""
        layers = cast("list[LlamaDecoderLayer]", list(self.model.layers))
        first = layers[0]
        return ModelView(
            layers=tuple(
                LayerView(
                    input_norm=layer.input_layernorm,
                    mlp_norm=layer.post_attention_layernorm,
                    qkv=layer.self_attn.qkv_proj,
                    o=layer.self_attn.o_proj,
                    gate_up=layer.mlp.gate_up_proj,
                    down=layer.mlp.down_proj,
                    attention=layer.self_attn.attn,
                    q_norm=layer.self_attn.q_norm,
                    k_norm=layer.self_attn.k_norm,
                )
                for layer in layers
            ),
            group=self.group,
            unit_offset=False,
            activation="silu",
            head_dim=first.self_attn.head_dim,
            num_heads=first.self_attn.num_heads,
            num_kv_heads=first.self_attn.num_kv_heads,
            inner=first.mlp.down_proj.weight_shape()[1],
            hidden=int(first.input_layernorm.weight.shape[0]),
        )

    def ignored_weights(self) -> frozenset[str]:
        """Rotary tables some old checkpoints store (recomputed here)."""
        return frozenset(
            f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(len(self.model.layers))
        )


class LlamaForSequenceClassification(LlamaForCausalLM):
    """Llama, Qwen2 and Qwen3 `*ForSequenceClassification` (cross-encoders, rerankers): the same decoder with a
    `score` head of `num_labels` outputs (no bias) in place of the LM head, as transformers'
    `GenericForSequenceClassification`; served by the pooling runner only, which applies the head to the pooled
    row (`classifier`)."""

    has_lm_head = False

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup | None = None,
    ) -> None:
        super().__init__(config, dtype=dtype, device=device, group=group)
        hidden = int(config.get_text_config().hidden_size)
        # Whole on every rank (a few rows): the driver applies it to a pooled row, which every rank holds whole.
        labels = config.num_labels or 2  # transformers' default when a config names no labels
        self.score = Linear(hidden, labels, bias=False, dtype=dtype, device=device)
        self.computes_logits = False

    def classifier(self) -> Linear:
        """The `score` head."""
        return self.score

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """A RuntimeError: the model has no LM head (the pooling runner, the only one that serves it, computes no
        logits)."""
        raise RuntimeError("a sequence-classification model has no LM head; it serves --runner pooling only")
