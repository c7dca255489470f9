"""Llava (LlavaForConditionalGeneration): a CLIP vision tower, a two-layer projector and a Llama-family decoder.

An image's features are the CLIP hidden states of `vision_feature_layer` (one layer, or several concatenated
along the hidden dimension), without the class token under the "default" `vision_feature_select_strategy` and
with it under "full", projected by linear_2(act(linear_1(.))) into the decoder's embedding space, where they
replace the image's placeholder tokens' embeddings.
"""

from __future__ import annotations

from typing import Any

import torch
from pagoda.server.models.conditional import ConditionalGeneration
from pagoda.server.models.layers import Linear
from pagoda.server.models.llama import LlamaForCausalLM
from pagoda.server.models.parallel import ParallelGroup
from pagoda.server.models.vit import ClipVisionTower, unused_layer_weights
from torch import Tensor, nn
from transformers import PretrainedConfig

_STRATEGIES = ("default", "full")


def feature_layers(config: PretrainedConfig) -> list[int]:
    """The `hidden_states` indices (0 = the embeddings, i = after layer i) that make an image's features."""
    layers = config.vision_feature_layer
    num_layers = int(config.vision_config.num_hidden_layers)
    chosen = [int(layers)] if isinstance(layers, int) else [int(layer) for layer in layers]
    # hidden_states has num_layers + 1 entries: a negative index counts from its end.
    return [layer if layer >= 0 else num_layers + 1 + layer for layer in chosen]


class LlavaMultiModalProjector(nn.Module):
    """linear_2(act(linear_1(features))): vision features (of every feature layer) to the decoder's hidden size."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        vision = int(config.vision_config.hidden_size) * len(feature_layers(config))
        text = int(config.text_config.hidden_size)
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        self.linear_1 = Linear(vision, text, bias=bias, dtype=dtype, device=device)
        # Imported here: transformers.activations takes 0.6 s, which a text model's start must not pay.
        from transformers.activations import ACT2FN

        self.act: Any = ACT2FN[config.projector_hidden_act]
        self.linear_2 = Linear(text, text, bias=bias, dtype=dtype, device=device)

    def forward(
        self, x: Tensor
    ) -> Tensor:  # [images, tokens, vision_hidden * layers] -> [images, tokens, hidden]
        """The projected features."""
        out: Tensor = self.linear_2(self.act(self.linear_1(x)))
        return out


class LlavaForConditionalGeneration(ConditionalGeneration):
    """Llava 1.5-style models: CLIP tower (only the layers the features read), projector, Llama-family decoder."""

    language_model: LlamaForCausalLM

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
        self.dtype, self.device = dtype, device
        self.strategy = str(config.vision_feature_select_strategy)
        if self.strategy not in _STRATEGIES:
            raise NotImplementedError(f"vision_feature_select_strategy {self.strategy!r} is not supported")
        self.feature_layers = feature_layers(config)
        # The vision tower is whole on every rank; the decoder is split as a text model would be.
        self.num_vision_layers = max(self.feature_layers)
        self.vision_tower = ClipVisionTower(
            config.vision_config, self.num_vision_layers, dtype=dtype, device=device
        )
        self.multi_modal_projector = LlavaMultiModalProjector(config, dtype=dtype, device=device)
        self.language_model = LlamaForCausalLM(config.text_config, dtype=dtype, device=device, group=group)

    def embed(self, input_ids: Tensor) -> Tensor:  # int64 [num_tokens] -> [num_tokens, hidden]
        """The decoder's token embeddings."""
        out: Tensor = self.language_model.model.embed_tokens(input_ids)
        return out

    def encode_pixels(self, pixels: Tensor) -> Tensor:  # [images, 3, H, W] -> [images, tokens, hidden]
        """Selected CLIP hidden states (class token dropped under "default"), concatenated, projected."""
        states = self.vision_tower(pixels)
        chosen = [states[layer] for layer in self.feature_layers]
        if self.strategy == "default":
            chosen = [state[:, 1:] for state in chosen]
        out: Tensor = self.multi_modal_projector(torch.cat(chosen, dim=-1))
        return out

    def ignored_weights(self) -> frozenset[str]:
        """The CLIP layers past the last feature layer, its post-layernorm (Llava reads hidden states) and stored
        position ids, and the decoder's stored rotary tables."""
        vision = self.config.vision_config
        text = frozenset(f"language_model.{name}" for name in self.language_model.ignored_weights())
        post = frozenset(
            {
                "vision_tower.post_layernorm.weight",
                "vision_tower.post_layernorm.bias",
                "vision_tower.embeddings.position_ids",  # a buffer older CLIP checkpoints stored
            }
        )
        return unused_layer_weights(vision, self.num_vision_layers, "vision_tower.") | post | text
