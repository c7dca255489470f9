"""What the `*ForConditionalGeneration` vision-language models share: a text decoder held as `language_model`
(our causal LM of its text config), a vision tower and a projector, and the checkpoint layouts they load from.

Parameter names are the layout transformers' `save_pretrained` writes (`language_model.model.*`,
`language_model.lm_head.weight`, `vision_tower.*`, `multi_modal_projector.*`); `checkpoint_name` maps the hub's
other layouts onto it: transformers 5's `model.language_model.*`, `lm_head.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*`, and the `vision_tower.vision_model.*` of the CLIP / SigLIP vision models.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence

import torch
from pagoda.server.models.attention import AttentionMetadata, LayerKVCache
from pagoda.server.models.base import FUSED_QKV_GATE_UP, KVCacheSpec
from pagoda.server.models.gemma3 import Gemma3ForCausalLM
from pagoda.server.models.llama import LlamaForCausalLM
from pagoda.server.models.vision import StepImages, VisionLanguageModel, embed_with_images
from pagoda.server.multimodal.inputs import ImageItem
from torch import Tensor

# (checkpoint prefix, parameter prefix), the first match wins.
_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_tower.vision_model.", "vision_tower."),
)


class ConditionalGeneration(VisionLanguageModel):
    """A vision tower and projector in front of a text decoder (`language_model`), which owns the KV cache and
    the LM head; subclasses embed the tokens and images (`embed`) and encode images."""

    packed_modules = FUSED_QKV_GATE_UP
    language_model: LlamaForCausalLM | Gemma3ForCausalLM
    dtype: torch.dtype  # the model's
    device: torch.device

    @abstractmethod
    def embed(self, input_ids: Tensor) -> Tensor:  # int64 [num_tokens] -> [num_tokens, hidden]
        """The text decoder's input embeddings of the tokens."""

    def forward(
        self,
        input_ids: Tensor,  # int64 [num_tokens]
        positions: Tensor,  # int64 [num_tokens]
        kv_caches: Sequence[LayerKVCache],  # one per layer
        attn: AttentionMetadata,
        images: StepImages | None = None,
    ) -> Tensor:  # [num_tokens, hidden]
        """Final hidden states; the rows `images.rows` take the encoder's embeddings instead of the tokens'."""
        x = embed_with_images(self.embed, input_ids, images)
        out: Tensor = self.language_model.forward_embeds(x, positions, kv_caches, attn)
        return out

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [num_rows, hidden] -> [num_rows, vocab]
        """The text decoder's logits."""
        logits: Tensor = self.language_model.compute_logits(hidden)
        return logits

    def kv_cache_spec(self) -> KVCacheSpec:
        """The text decoder's KV cache (the vision tower keeps none)."""
        spec: KVCacheSpec = self.language_model.kv_cache_spec()
        return spec

    def checkpoint_name(self, name: str) -> str:
        """The saved layout's name of a tensor in any of the hub's layouts (see the module docstring)."""
        for old, new in _RENAMES:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def weight_aliases(self) -> Mapping[str, str]:
        """The text decoder's (a tied LM head is its embedding)."""
        inner: Mapping[str, str] = self.language_model.weight_aliases()
        return {f"language_model.{k}": f"language_model.{v}" for k, v in inner.items()}

    def pack_weights(self, batch_size: int) -> int:
        """The text decoder's weights (and tied head) only: the vision tower runs on whole images, rarely."""
        self.language_model.computes_logits = self.computes_logits
        packed: int = self.language_model.pack_weights(batch_size)
        return packed

    @abstractmethod
    def encode_pixels(self, pixels: Tensor) -> Tensor:  # [images, 3, H, W] -> [images, tokens, hidden]
        """The projected image features of a batch of same-sized images."""

    @torch.inference_mode()
    def encode_images(
        self, images: Sequence[ImageItem]
    ) -> list[Tensor]:  # one [item.length, hidden] per image
        """Each image's embedding rows, all images in one batch (the processors make them one size)."""
        if not images:
            return []
        pixels = torch.cat([item.tensors["pixel_values"] for item in images]).to(self.device)
        rows = list(self.encode_pixels(pixels.to(self.dtype)).unbind(0))
        for item, row in zip(images, rows, strict=True):
            if row.shape[0] != item.length:
                raise ValueError(
                    f"an image encodes to {row.shape[0]} rows but its span has {item.length} tokens"
                )
        return rows
