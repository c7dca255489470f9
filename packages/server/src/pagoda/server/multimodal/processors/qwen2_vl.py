"""Qwen2-VL / Qwen2.5-VL prompts: each image marker becomes grid_t * grid_h * grid_w / merge^2 `<|image_pad|>`
tokens, and every token gets its 3-D M-RoPE position as transformers' `get_rope_index` computes it.

Built from the folder's PIL image processor and tokenizer: transformers' `AutoProcessor` for these models also
loads a video processor, which needs torchvision (not importable beside our torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from pagoda.server.multimodal.inputs import ImageItem, MultiModalInputs, ProcessedPrompt, content_key
from PIL import Image
from torch import Tensor
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

IMAGE_PAD = "<|image_pad|>"
IMAGE_MARKER = "<|vision_start|>" + IMAGE_PAD + "<|vision_end|>"


def mrope_positions(
    num_tokens: int,
    images: Sequence[tuple[int, tuple[int, int, int]]],  # (offset, (grid_t, grid_h, grid_w)) in prompt order
    merge: int,
) -> tuple[Tensor, int]:  # int64 [3, num_tokens], delta
    """transformers' `get_rope_index` for one prompt: a text token advances all three axes by one; an image's
    tokens start at the running position and add their (frame, row, column) in the merged grid, and the text
    after it resumes at the running position plus the image's larger merged side. The delta is what a later
    token at 1-D position p adds: p + delta on every axis."""
    parts: list[Tensor] = []
    pos = 0  # the running position
    cursor = 0  # the next prompt token not yet placed
    for offset, (t, h, w) in images:
        text = offset - cursor
        parts.append(torch.arange(text, dtype=torch.int64).expand(3, text) + pos)
        pos += text
        lh, lw = h // merge, w // merge
        frame, row, col = torch.meshgrid(torch.arange(t), torch.arange(lh), torch.arange(lw), indexing="ij")
        parts.append(torch.stack([frame, row, col]).reshape(3, -1) + pos)
        pos += max(h, w) // merge
        cursor = offset + t * lh * lw
    text = num_tokens - cursor
    parts.append(torch.arange(text, dtype=torch.int64).expand(3, text) + pos)
    positions = torch.cat(parts, dim=1)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


class Qwen2VLPromptProcessor:
    """The `MultiModalProcessor` of Qwen2-VL and Qwen2.5-VL folders."""

    image_marker = IMAGE_MARKER

    def __init__(self, image_processor: Qwen2VLImageProcessorPil, tokenizer: PreTrainedTokenizerBase) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.merge = int(image_processor.merge_size)

    @classmethod
    def from_folder(cls, path: Path) -> Qwen2VLPromptProcessor:
        """The processor of a model folder (its preprocessor_config.json and tokenizer)."""
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(path)
        return cls(image_processor, tokenizer)

    def process(
        self, prompt: str, images: Sequence[Image.Image], *, add_special_tokens: bool = True
    ) -> ProcessedPrompt:
        """Token ids of `prompt` with each marker's pad expanded to its image's tokens, the images' spans and
        tensors, and the M-RoPE positions; ValueError when markers and images differ in number."""
        pieces = prompt.split(IMAGE_MARKER)
        if len(pieces) - 1 != len(images):
            raise ValueError(
                f"the prompt has {len(pieces) - 1} image marker(s) {IMAGE_MARKER!r} but {len(images)} image(s) "
                "were given"
            )
        tensors = [self._image_tensors(image) for image in images]
        counts = [int(t["image_grid_thw"].prod()) // self.merge**2 for t in tensors]
        # Expanded as transformers' processor does, remembering each image's pad run by characters: a pad
        # token written in the text itself stays a text token, outside every image's span.
        text, char_spans = pieces[0], []
        for piece, count in zip(pieces[1:], counts, strict=True):
            text += "<|vision_start|>"
            char_spans.append((len(text), len(text) + count * len(IMAGE_PAD)))
            text += IMAGE_PAD * count + "<|vision_end|>" + piece
        encoding = self.tokenizer(text, return_offsets_mapping=True, add_special_tokens=add_special_tokens)
        token_ids = [int(i) for i in encoding["input_ids"]]
        offsets: list[tuple[int, int]] = encoding["offset_mapping"]
        items: list[ImageItem] = []
        for image, image_tensors, count, (start, end) in zip(
            images, tensors, counts, char_spans, strict=True
        ):
            rows = [i for i, (a, b) in enumerate(offsets) if start <= a and b <= end and b > a]
            if len(rows) != count or rows != list(range(rows[0], rows[0] + count)):
                raise ValueError(f"the tokenizer did not keep {IMAGE_PAD!r} as one token per image patch")
            items.append(ImageItem(rows[0], count, content_key(image), image_tensors))
        grids = [(item.offset, _grid(item)) for item in items]
        positions, delta = mrope_positions(len(token_ids), grids, self.merge)
        return ProcessedPrompt(tuple(token_ids), MultiModalInputs(tuple(items), positions, delta))

    def _image_tensors(self, image: Image.Image) -> dict[str, Tensor]:
        """pixel_values [num_patches, C * T * P * P] and image_grid_thw int64 [1, 3] of one image."""
        out = self.image_processor(images=[image], return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].to(torch.int64)}


def _grid(item: ImageItem) -> tuple[int, int, int]:
    """(grid_t, grid_h, grid_w) of an image item."""
    t, h, w = (int(v) for v in item.tensors["image_grid_thw"].reshape(3).tolist())
    return t, h, w
