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
from pagoda.server.models.attention import AttentionMetadata, LayerKVCache
from pagoda.server.models.layers import RotaryEmbedding
from pagoda.server.models.llama import LlamaForCausalLM
from pagoda.server.models.parallel import ParallelGroup
from pagoda.server.models.qwen2_vl_vision import QwenVisionTransformer
from pagoda.server.models.vision import StepImages, VisionLanguageModel, embed_with_images
from pagoda.server.multimodal.inputs import ImageItem
from torch import Tensor
from transformers import PretrainedConfig

# transformers 5's module paths -> the checkpoint's (and this model's) paths.
_V5_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: each frequency of a head rotates by the position on its section's axis (temporal, row, column);
    plain rope where the positions are 1-D (text tokens sit at the same position on all three axes)."""

    def __init__(self, config: PretrainedConfig, device: torch.device) -> None:
        super().__init__(config, None, device)
        sections = [int(s) for s in (config.rope_parameters or {}).get("mrope_section") or []]
        if sum(sections) != self.inv_freq.shape[0]:
            raise ValueError(f"mrope_section {sections} must sum to head_dim / 2 = {self.inv_freq.shape[0]}")
        # The axis (0, 1, 2) whose position drives each frequency: section i uses axis i % 3.
        axes = torch.cat([torch.full((size,), i % 3, dtype=torch.int64) for i, size in enumerate(sections)])
        self.axes: Tensor  # int64 [head_dim // 2]
        self.register_buffer("axes", axes.to(device), persistent=False)

    def forward(
        self,
        positions: Tensor,  # int64 [num_tokens]
        dtype: torch.dtype,
        mrope_positions: Tensor | None = None,  # int64 [3, num_tokens]; None: `positions` on every axis
    ) -> tuple[Tensor, Tensor]:  # cos, sin: [num_tokens, 1, head_dim // 2] each
        """cos and sin of every token's angles, in float32 then cast, as transformers computes them."""
        if mrope_positions is None:
            return super().forward(positions, dtype)
        # [3, num_tokens, head_dim // 2], then each frequency's own axis.
        all_axes = mrope_positions.to(self.inv_freq.device)[..., None].float() * self.inv_freq
        freqs = all_axes.gather(0, self.axes.expand(1, all_axes.shape[1], -1))[0]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class Qwen2VLForConditionalGeneration(VisionLanguageModel, LlamaForCausalLM):
    """Qwen2-VL (and, by its vision config, Qwen2.5-VL): vision tower and merger before our Qwen2 decoder, whose
    rotary embedding is M-RoPE."""

    uses_mrope = True

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup | None = None,
    ) -> None:
        text = config.get_text_config()
        LlamaForCausalLM.__init__(self, text, dtype=dtype, device=device, group=group)
        self.config = config
        self.model.rotary_emb = MRotaryEmbedding(text, device)
        # Whole on every rank: the tower is small beside the decoder, and its output feeds every rank's embedding.
        self.visual = QwenVisionTransformer(config.vision_config, dtype=dtype, device=device)
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
        x = embed_with_images(self.model.embed_tokens, input_ids, images)
        mrope = None if images is None else images.mrope_positions
        rope = self.model.rotary_emb(positions, x.dtype, mrope)
        return self.forward_embeds(x, positions, kv_caches, attn, rope)

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
