"""Gemma 3 with images (Gemma3ForConditionalGeneration): SigLIP vision tower, Gemma 3 projector, Gemma 3 decoder.

The projector average-pools the tower's patch grid down to `mm_tokens_per_image` tokens, normalises them with a
(1 + w) RMSNorm and projects them by a plain matrix into the decoder's space. Token embeddings are scaled by
sqrt(hidden_size) but image features go in unscaled, as in transformers. An image's tokens attend to each other
in both directions (`bidirectional_images`; see `image_attention.bidirectional_metadata`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pagoda.server.models.conditional import ConditionalGeneration
from pagoda.server.models.gemma3 import Gemma3ForCausalLM
from pagoda.server.models.layers import RMSNorm
from pagoda.server.models.parallel import ParallelGroup
from pagoda.server.models.vit import SiglipVisionTower
from torch import Tensor, nn
from transformers import PretrainedConfig


class Gemma3MultiModalProjector(nn.Module):
    """Average-pool the patch grid to mm_tokens_per_image, soft-embedding RMSNorm, project to the decoder."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        vision = config.vision_config
        hidden = int(vision.hidden_size)
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(hidden, int(config.text_config.hidden_size), dtype=dtype, device=device),
            requires_grad=False,
        )
        self.mm_soft_emb_norm = RMSNorm(
            hidden, float(vision.layer_norm_eps), unit_offset=True, dtype=dtype, device=device
        )
        self.patches_per_side = int(vision.image_size) // int(vision.patch_size)
        tokens_per_side = int(int(config.mm_tokens_per_image) ** 0.5)
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, x: Tensor) -> Tensor:  # [images, patches, vision_hidden] -> [images, tokens, hidden]
        """The pooled, normalised, projected image features."""
        images, _, hidden = x.shape
        grid = x.transpose(1, 2).reshape(images, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        tokens = pooled.shape[1]
        normed = self.mm_soft_emb_norm(pooled.reshape(images * tokens, hidden).contiguous())
        out: Tensor = torch.matmul(normed, self.mm_input_projection_weight).type_as(x)
        return out.view(images, tokens, -1)


class Gemma3ForConditionalGeneration(ConditionalGeneration):
    """Gemma 3 4B/12B/27B-style models: SigLIP tower, projector, Gemma 3 decoder, images bidirectional."""

    bidirectional_images = True
    language_model: Gemma3ForCausalLM

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
        # Whole on every rank; the decoder is split as a text model would be.
        self.vision_tower = SiglipVisionTower(config.vision_config, dtype=dtype, device=device)
        self.multi_modal_projector = Gemma3MultiModalProjector(config, dtype=dtype, device=device)
        self.language_model = Gemma3ForCausalLM(config.text_config, dtype=dtype, device=device, group=group)
        # transformers' Gemma3ForConditionalGeneration never soft-caps its logits (Gemma 3's VLM checkpoints set
        # no final_logit_softcapping anyway): neither does this model, whatever the text config says.
        self.language_model.final_logit_softcapping = None

    def embed(self, input_ids: Tensor) -> Tensor:  # int64 [num_tokens] -> [num_tokens, hidden]
        """The decoder's token embeddings, scaled by sqrt(hidden_size) (image rows then go in unscaled)."""
        model = self.language_model.model
        out: Tensor = model.embed_tokens(input_ids) * model.embed_scale
        return out

    def encode_pixels(self, pixels: Tensor) -> Tensor:  # [images, 3, H, W] -> [images, tokens, hidden]
        """SigLIP's last hidden state, through the projector."""
        out: Tensor = self.multi_modal_projector(self.vision_tower(pixels))
        return out

    def ignored_weights(self) -> frozenset[str]:
        """SigLIP's attention-pooling head (unused: Gemma 3 reads the patch states) and stored position ids."""
        return frozenset({"vision_tower.embeddings.position_ids"}) | frozenset(
            f"vision_tower.head.{name}"
            for name in (
                "probe",
                "attention.in_proj_weight",
                "attention.in_proj_bias",
                "attention.out_proj.weight",
                "attention.out_proj.bias",
                "layernorm.weight",
                "layernorm.bias",
                "mlp.fc1.weight",
                "mlp.fc1.bias",
                "mlp.fc2.weight",
                "mlp.fc2.bias",
            )
        )
