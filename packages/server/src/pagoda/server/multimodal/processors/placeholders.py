"""What the Llava and Gemma 3 processors share: run the folder's transformers processor on the prompt and its
images, then find each image's run of placeholder tokens and its own slice of `pixel_values`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pagoda.server.multimodal.inputs import ImageItem, MultiModalInputs, ProcessedPrompt, content_key
from PIL import Image
from transformers import AutoProcessor


def placeholder_runs(token_ids: Sequence[int], placeholder: int) -> list[tuple[int, int]]:
    """(offset, length) of every maximal run of `placeholder` in `token_ids`, in order."""
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for i, token in enumerate([*token_ids, None]):
        if token == placeholder and start is None:
            start = i
        elif token != placeholder and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


class PlaceholderProcessor:
    """A processor whose images each expand to one run of `placeholder_token`, of `tokens_per_image(pixels)`."""

    image_marker: str
    placeholder_token: str

    def __init__(self, folder: Path) -> None:
        # Offline: the folder holds the processor, image processor and tokenizer configs.
        self.processor: Any = AutoProcessor.from_pretrained(folder)  # type: ignore[no-untyped-call]
        tokenizer = self.processor.tokenizer
        self.placeholder_id = int(tokenizer.convert_tokens_to_ids(self.placeholder_token))

    def tokens_per_image(self, pixels: torch.Tensor) -> int:  # pixels [1, 3, H, W]
        """How many placeholder tokens one image of these pixels takes."""
        raise NotImplementedError

    def process(
        self, prompt: str, images: Sequence[Image.Image], *, add_special_tokens: bool = True
    ) -> ProcessedPrompt:
        """Token ids and images of `prompt`; ValueError when its markers and `images` disagree, or when the prompt
        writes the placeholder token as text."""
        markers = prompt.count(self.image_marker)
        if markers != len(images):
            raise ValueError(
                f"the prompt has {markers} image marker(s) {self.image_marker!r} but {len(images)} image(s) were "
                "given: write one marker per image (a literal marker in the text counts as one)"
            )
        if not images:
            ids = self.processor.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
            token_ids = tuple(int(token) for token in ids)
            if self.placeholder_id in token_ids:
                raise ValueError(
                    f"the prompt writes the image placeholder {self.placeholder_token!r} as text"
                )
            return ProcessedPrompt(token_ids, MultiModalInputs(()))
        rgb = [image.convert("RGB") for image in images]
        out = self.processor(
            text=[prompt], images=rgb, return_tensors="pt", add_special_tokens=add_special_tokens
        )
        token_ids = tuple(int(token) for token in out["input_ids"][0].tolist())
        pixels: torch.Tensor = out["pixel_values"]
        if pixels.shape[0] != len(images):
            raise ValueError(f"the processor made {pixels.shape[0]} image tensors of {len(images)} images")
        runs = placeholder_runs(token_ids, self.placeholder_id)
        want = [self.tokens_per_image(pixels[i : i + 1]) for i in range(len(images))]
        if [length for _, length in runs] != want:
            raise ValueError(
                f"the prompt's placeholder tokens {self.placeholder_token!r} do not match its {len(images)} "
                f"image(s) (runs {[length for _, length in runs]}, expected {want}): the prompt may write the "
                "placeholder as text"
            )
        items = tuple(
            ImageItem(offset, length, content_key(image), {"pixel_values": pixels[i : i + 1].clone()})
            for i, ((offset, length), image) in enumerate(zip(runs, images, strict=True))
        )
        return ProcessedPrompt(token_ids, MultiModalInputs(items))
