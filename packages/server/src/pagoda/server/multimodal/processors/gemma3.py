"""Gemma 3's processor: "<start_of_image>" in the prompt becomes boi, the image's `<image_soft_token>` run, eoi."""

from __future__ import annotations

import torch
from pagoda.server.multimodal.processors.placeholders import PlaceholderProcessor


class Gemma3Processor(PlaceholderProcessor):
    """Each image: `image_seq_length` soft tokens (the span; boi and eoi around it are text)."""

    image_marker = "<start_of_image>"
    placeholder_token = "<image_soft_token>"

    def tokens_per_image(self, pixels: torch.Tensor) -> int:  # pixels [1, 3, H, W]
        """The processor's fixed `image_seq_length` (pan-and-scan crops are not supported)."""
        return int(self.processor.image_seq_length)
