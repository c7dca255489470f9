"""The seam between a vision-language model folder's own processor and the engine.

Each supported architecture has a `MultiModalProcessor` that expands a prompt text holding one image marker per
image (what the folder's chat template writes for an image content part) into the prompt's token ids, with every
image's placeholder span and tensors (`ImageItem`). The folder's `AutoProcessor` (or its image processor and
tokenizer, where AutoProcessor would need torchvision) decides how many tokens an image takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pagoda.server.multimodal.inputs import ProcessedPrompt
    from PIL import Image


class MultiModalProcessor(Protocol):
    """Turns a prompt text with image markers, and its images, into a `ProcessedPrompt`."""

    # What the chat template writes for one image in a prompt, and what a plain-text prompt writes where an
    # image goes (Llava "<image>", Gemma 3 "<start_of_image>", Qwen2-VL "<|vision_start|><|image_pad|><|vision_end|>").
    image_marker: str

    def process(
        self, prompt: str, images: Sequence[Image.Image], *, add_special_tokens: bool = True
    ) -> ProcessedPrompt:
        """Token ids and images of `prompt` (with the tokenizer's special tokens, BOS, unless the prompt is a
        rendered chat template that writes them itself); ValueError (naming what is wrong) when its markers and
        `images` disagree in number."""
        ...
