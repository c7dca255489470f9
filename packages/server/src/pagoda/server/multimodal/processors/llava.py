"""Llava's processor: "<image>" in the prompt becomes one image's run of "<image>" placeholder tokens."""

from __future__ import annotations

import torch
from pagoda.server.multimodal.processors.placeholders import PlaceholderProcessor


class LlavaProcessor(PlaceholderProcessor):
    """Each image: (H / patch) * (W / patch) placeholders, plus CLIP's class token under the "full" strategy."""

    image_marker = "<image>"
    placeholder_token = "<image>"

    def tokens_per_image(self, pixels: torch.Tensor) -> int:  # pixels [1, 3, H, W]
        """Patches of the image, with the processor's extra tokens less the ones the strategy drops."""
        proc = self.processor
        patch = int(proc.patch_size)
        tokens = (int(pixels.shape[-2]) // patch) * (int(pixels.shape[-1]) // patch)
        tokens += int(proc.num_additional_image_tokens)
        return tokens - (1 if proc.vision_feature_select_strategy == "default" else 0)
