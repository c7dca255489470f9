"""What the API needs to take images: the model's multimodal processor (None: a text-only model) and the media
policy; built once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pagoda.server.config import MultiModalConfig
from pagoda.server.multimodal.folder import model_processor
from pagoda.server.multimodal.media import MediaPolicy
from pagoda.server.multimodal.processor import MultiModalProcessor


@dataclass(frozen=True, slots=True)
class ImageFront:
    """The model's processor (None: the model takes no images) and where images may come from."""

    processor: MultiModalProcessor | None = None
    policy: MediaPolicy = field(default_factory=MediaPolicy)


def image_front(folder: str | Path, config: MultiModalConfig) -> ImageFront:
    """The API's image support for the model in `folder` under `config`'s policy."""
    return ImageFront(model_processor(folder), MediaPolicy.from_config(config))
