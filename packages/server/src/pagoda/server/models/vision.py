"""What a vision-language model offers the runner beside a `CausalLM`: an image encoder, and a forward pass that
takes the step's encoder rows in place of placeholder embeddings."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from pagoda.server.models.attention import AttentionMetadata, LayerKVCache
from pagoda.server.models.base import CausalLM
from pagoda.server.multimodal.inputs import ImageItem
from torch import Tensor


@dataclass(frozen=True, slots=True)
class StepImages:
    """The encoder's rows for one step's tokens (and M-RoPE positions where the model uses them)."""

    rows: Tensor  # int64 [num_image_rows]: the step's token rows whose embeddings come from the encoder
    embeds: Tensor  # [num_image_rows, hidden_size], in the model's dtype
    # int64 [3, num_tokens]: every token's (temporal, height, width) position (M-RoPE models); None otherwise.
    mrope_positions: Tensor | None = None


def embed_with_images(
    embed: Callable[[Tensor], Tensor],  # int64 [num_tokens] -> [num_tokens, hidden_size]
    input_ids: Tensor,  # int64 [num_tokens]
    images: StepImages | None,
) -> Tensor:  # [num_tokens, hidden_size]
    """The step's input embeddings: `embed` of the tokens, with the encoder's rows at `images.rows`. Placeholder ids
    may lie past the text vocabulary (Gemma 3's): those rows look up id 0, as transformers does, then are replaced."""
    if images is None or images.rows.numel() == 0:
        return embed(input_ids)
    rows = images.rows.to(input_ids.device)
    x = embed(input_ids.index_fill(0, rows, 0))
    return x.index_copy(0, rows, images.embeds.to(x.device, x.dtype))


class VisionLanguageModel(CausalLM):
    """A language model whose prompt may hold images: `encode_images` turns images into embedding rows, and
    `forward` takes them for the placeholder tokens of the step."""

    # True where the tokens of one image attend to each other in both directions (Gemma 3): the scheduler then
    # never ends a prefill chunk inside an image, and the runner lets the image's queries see its whole span.
    bidirectional_images: ClassVar[bool] = False
    # True where positions are 3-D (Qwen2-VL's M-RoPE): `forward` reads `images.mrope_positions` when given.
    uses_mrope: ClassVar[bool] = False

    @abstractmethod
    def encode_images(
        self, images: Sequence[ImageItem]
    ) -> list[Tensor]:  # one [item.length, hidden_size] per image, in the model's dtype
        """The language-model embeddings of each image's placeholder tokens (vision tower and projector), batched
        where the images' shapes allow."""

    @abstractmethod
    def forward(
        self,
        input_ids: Tensor,  # int64 [num_tokens]
        positions: Tensor,  # int64 [num_tokens]
        kv_caches: Sequence[LayerKVCache],  # one per layer
        attn: AttentionMetadata,
        images: StepImages | None = None,
    ) -> Tensor:  # [num_tokens, hidden_size]
        """Final hidden states; the embeddings of `images.rows` are `images.embeds` instead of the token ids'."""
