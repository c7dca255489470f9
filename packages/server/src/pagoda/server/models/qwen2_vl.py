"""Qwen2-VL and Qwen2.5-VL: the vision tower (`qwen2_vl_vision`) and a Qwen2 decoder with M-RoPE.

M-RoPE splits the rotary frequencies of a head into three sections (`rope_parameters.mrope_section`, summing to
head_dim / 2): the first rotates by a token's temporal position, the second by its row, the third by its column.
Text tokens have the same position on all three axes, so with 1-D positions this is plain rope.

Parameter names are those of the checkpoints transformers saves (`model.embed_tokens`, `model.layers.*`,
`visual.*`, `lm_head`); transformers 5's in-memory names (`model.language_model.*`, `model.visual.*`) load too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch
from pagoda.server.models.attention import Attention, AttentionMetadata, LayerKVCache
from pagoda.server.models.base import DecoderLM, sharded_kv_spec
from pagoda.server.models.layers import RMSNorm, apply_rotary, head_dim_of, rope_inv_freq
from pagoda.server.models.llama import LlamaMLP, layer_sliding_windows
from pagoda.server.models.parallel import ParallelGroup, SingleRank
from pagoda.server.models.parallel_layers import ParallelLMHead, VocabParallelEmbedding, attention_projections
from pagoda.server.models.qwen2_vl_vision import QwenVisionTransformer
from pagoda.server.models.vision import StepImages, VisionLanguageModel
from pagoda.server.multimodal.inputs import ImageItem
from torch import Tensor, nn
from transformers import PretrainedConfig

# transformers 5's module paths -> the checkpoint's (and this model's) paths.
_V5_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class Qwen2VLAttention(nn.Module):
    """Qwen2's attention (q/k/v biases, no output bias) over the paged cache; rope from the caller's cos/sin."""

    def __init__(
        self,
        config: PretrainedConfig,  # the text config
        sliding_window: int | None,
        *,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.qkv_proj, self.o_proj = attention_projections(
            config, qkv_bias=True, o_bias=False, dtype=dtype, device=device, group=group
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.heads.num_heads, self.qkv_proj.heads.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
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
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out: Tensor = self.o_proj(self.attn(q, k, v, kv_cache, attn))
        return out


class Qwen2VLDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

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
        eps, hidden = float(config.rms_norm_eps), int(config.hidden_size)
        self.self_attn = Qwen2VLAttention(config, sliding_window, dtype=dtype, device=device, group=group)
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
        attn_out: Tensor = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn)
        x, normed = self.post_attention_layernorm.add(attn_out, x)
        mlp_out: Tensor = self.mlp(normed)
        return x + mlp_out


class MRotaryEmbedding(nn.Module):
    """M-RoPE: each frequency of a head rotates by the position on its section's axis (temporal, row, column)."""

    def __init__(self, config: PretrainedConfig, device: torch.device) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(config, None, device)
        self.inv_freq: Tensor  # float32 [head_dim // 2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        sections = [int(s) for s in (config.rope_parameters or {}).get("mrope_section") or []]
        if sum(sections) != inv_freq.shape[0]:
            raise ValueError(f"mrope_section {sections} must sum to head_dim / 2 = {inv_freq.shape[0]}")
        # The axis (0, 1, 2) whose position drives each frequency: section i uses axis i % 3.
        axes = torch.cat([torch.full((size,), i % 3, dtype=torch.int64) for i, size in enumerate(sections)])
        self.axes: Tensor  # int64 [head_dim // 2]
        self.register_buffer("axes", axes.to(device), persistent=False)

    def forward(
        self,
        positions: Tensor,  # int64 [num_tokens]
        mrope_positions: Tensor | None,  # int64 [3, num_tokens], or None: `positions` on every axis
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]:  # cos, sin: [num_tokens, 1, head_dim // 2] each
        """cos and sin of every token's angles, in float32 then cast, as transformers computes them."""
        if mrope_positions is None:
            freqs = positions[:, None].float() * self.inv_freq[None, :]
        else:
            # [3, num_tokens, head_dim // 2], then each frequency's own axis.
            all_axes = mrope_positions.to(self.inv_freq.device)[..., None].float() * self.inv_freq
            freqs = all_axes.gather(0, self.axes.expand(1, all_axes.shape[1], -1))[0]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class Qwen2VLTextModel(nn.Module):
    """Embedding, decoder layers, final norm and M-RoPE (the checkpoint's `model.` prefix)."""

    def __init__(
        self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device, group: ParallelGroup
    ) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.embed_tokens = VocabParallelEmbedding(
            int(config.vocab_size), hidden, dtype=dtype, device=device, group=group
        )
        self.layers = nn.ModuleList(
            Qwen2VLDecoderLayer(config, window, dtype=dtype, device=device, group=group)
            for window in layer_sliding_windows(config)
        )
        self.norm = RMSNorm(hidden, float(config.rms_norm_eps), unit_offset=False, dtype=dtype, device=device)
        self.rotary_emb = MRotaryEmbedding(config, device)


class Qwen2VLForConditionalGeneration(VisionLanguageModel, DecoderLM):
    """Qwen2-VL (and, by its vision config, Qwen2.5-VL): vision tower, merger and a Qwen2 decoder with M-RoPE."""

    uses_mrope = True
    model: Qwen2VLTextModel

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
        text = config.get_text_config()
        self.group = group or SingleRank()
        self.model = Qwen2VLTextModel(text, dtype=dtype, device=device, group=self.group)
        # Whole on every rank: the tower is small beside the decoder, and its output feeds every rank's embedding.
        self.visual = QwenVisionTransformer(config.vision_config, dtype=dtype, device=device)
        self.spec = sharded_kv_spec(text, int(text.num_hidden_layers), self.group)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head: ParallelLMHead | None = None
        if not self.tie_word_embeddings:
            hidden, vocab = int(text.hidden_size), int(text.vocab_size)
            self.lm_head = ParallelLMHead(vocab, hidden, dtype=dtype, device=device, group=self.group)
        self._aliases = self._checkpoint_aliases()

    def encode_images(self, images: Sequence[ImageItem]) -> list[Tensor]:  # one [item.length, hidden] each
        """All images through the tower in one pass (attention stays within each image), split per image."""
        if not images:
            return []
        device = self.model.norm.weight.device
        grids: list[tuple[int, int, int]] = []
        for item in images:
            t, h, w = (int(v) for v in item.tensors["image_grid_thw"].reshape(3).tolist())
            if t * h * w // self.visual.merge**2 != item.length:
                raise ValueError(
                    f"image grid {(t, h, w)} makes {t * h * w // self.visual.merge**2} tokens, not {item.length}"
                )
            grids.append((t, h, w))
        patches = torch.cat([item.tensors["pixel_values"] for item in images]).to(device)
        embeds = self.visual(patches, grids).to(self.model.norm.weight.dtype)
        return list(embeds.split([item.length for item in images]))

    def forward(
        self,
        input_ids: Tensor,  # int64 [num_tokens]
        positions: Tensor,  # int64 [num_tokens]
        kv_caches: Sequence[LayerKVCache],  # one per layer
        attn: AttentionMetadata,
        images: StepImages | None = None,
    ) -> Tensor:  # [num_tokens, hidden]
        """Final hidden states; image rows take the encoder's embeddings, and M-RoPE positions where given."""
        x: Tensor = self.model.embed_tokens(input_ids)
        mrope: Tensor | None = None
        if images is not None:
            if images.rows.numel():
                x = x.index_copy(0, images.rows.to(x.device), images.embeds.to(x.device, x.dtype))
            mrope = images.mrope_positions
        cos, sin = self.model.rotary_emb(positions, mrope, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, attn)
        out: Tensor = self.model.norm(x)
        return out

    def weight_aliases(self) -> Mapping[str, str]:
        """transformers 5's names (`model.language_model.*`, `model.visual.*`) and, when tied, `lm_head`."""
        return self._aliases

    def _checkpoint_aliases(self) -> Mapping[str, str]:
        """Every transformers 5 name of a parameter (checkpoint q/k/v and gate/up names of fused ones too)."""
        names: set[str] = set()
        fused_leaves: dict[str, list[str]] = {}
        for leaf, packed in self.packed_modules.items():
            fused_leaves.setdefault(packed.module, []).append(leaf)
        for name, _ in self.named_parameters():
            names.add(name)
            parent, _, attr = name.rpartition(".")
            owner, _, leaf = parent.rpartition(".")
            names.update(f"{owner}.{ckpt}.{attr}" for ckpt in fused_leaves.get(leaf, []))
        aliases = {
            new + name[len(old) :]: name
            for name in names
            for new, old in _V5_PREFIXES
            if name.startswith(old)
        }
        aliases.update(super().weight_aliases())
        return MappingProxyType(aliases)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the same decoder; its vision config selects RMSNorm + SwiGLU blocks and window attention."""
