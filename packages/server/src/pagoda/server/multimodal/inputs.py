"""A processed multimodal prompt: its token ids, where each image's placeholder tokens sit, and the image tensors.

An image becomes `length` contiguous placeholder tokens of the prompt (Llava's `<image>`, Gemma 3's
`<image_soft_token>`, Qwen2-VL's `<|image_pad|>`); the model's vision encoder turns the image's tensors into
exactly `length` rows of embeddings, which replace those tokens' embeddings before the language model runs. From
there the image's tokens live in the paged KV cache like text. The prefix cache tells images apart by
`content_key`, a digest of the decoded pixels that the allocator hashes in place of the placeholder ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the front end's import path stays free of torch and PIL until used
    from PIL import Image
    from torch import Tensor

# Content keys are negative 63-bit integers: no token id (never negative) hashes like an image.
_KEY_BITS = 62


def content_key(image: Image.Image) -> int:
    """A digest of an image's decoded pixels (mode, size and bytes) as a negative int64: equal for the same
    picture whatever file format or URL carried it, different for any other picture."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return -1 - (int.from_bytes(digest.digest()[:8], "little") >> (64 - _KEY_BITS))


@dataclass(frozen=True, slots=True)
class ImageItem:
    """One image of a prompt: its placeholder span and the processor's tensors for it alone."""

    offset: int  # prompt position of its first placeholder token
    length: int  # placeholder tokens: the encoder's output rows for this image
    content_key: int  # `content_key` of the decoded image (the prefix cache's key for these positions)
    # The processor's outputs for this image only, batch dimension of 1 where the processor has one (Llava and
    # Gemma 3: pixel_values [1, 3, H, W]; Qwen2-VL: pixel_values [num_patches, C * T * P * P], image_grid_thw
    # [1, 3]). Kept on the CPU; the encoder moves them to its device.
    tensors: Mapping[str, Tensor] = field(default_factory=dict)

    @property
    def end(self) -> int:
        """One past its last placeholder position."""
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class MultiModalInputs:
    """The images of one prompt (in prompt order, spans disjoint) and, for M-RoPE models, the prompt's 3-D
    positions."""

    images: tuple[ImageItem, ...]
    # Qwen2-VL's M-RoPE: int64 [3, prompt_len] (temporal, height, width position of every prompt token); a
    # token at position p >= prompt_len has p + mrope_delta on all three axes. None for 1-D rope models.
    mrope_positions: Tensor | None = None
    mrope_delta: int = 0

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens of all its images."""
        return sum(item.length for item in self.images)


def block_keys(token_ids: Sequence[int], multi_modal: MultiModalInputs | None) -> list[int]:
    """What the prefix cache hashes for a prompt (the scheduler's `Request.block_key_ids`): its token ids, with
    each image's content key at the image's placeholder positions (a router matches these against the blocks
    the cores publish)."""
    keys = list(token_ids)
    for item in () if multi_modal is None else multi_modal.images:
        keys[item.offset : item.end] = [item.content_key] * item.length
    return keys


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """What a multimodal processor makes of a prompt text and its images."""

    token_ids: tuple[int, ...]
    multi_modal: MultiModalInputs
