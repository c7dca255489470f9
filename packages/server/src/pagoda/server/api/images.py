"""What the API needs to take images: the model's multimodal processor (None: a text-only model) and the media
policy; built once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pagoda.server.config import MultiModalConfig
from pagoda.server.multimodal.media import MediaPolicy
from pagoda.server.multimodal.processor import MultiModalProcessor
from pagoda.server.multimodal.registry import processor_for


@dataclass(frozen=True, slots=True)
class ImageFront:
    """The model's processor (None: the model takes no images) and where images may come from."""

    processor: MultiModalProcessor | None = None
    policy: MediaPolicy = field(default_factory=MediaPolicy)


def model_processor(folder: str | Path) -> MultiModalProcessor | None:
    """The multimodal processor of a Hugging Face model folder, by its config's architecture; None for a text-only
    model, or for a model that is no such folder (a GGUF file, a packaged model)."""
    path = Path(folder)
    if not (path / "config.json").is_file():
        return None
    from transformers import AutoConfig  # seconds to import: only once a folder is known

    return processor_for(path, AutoConfig.from_pretrained(path))


def image_front(folder: str | Path, config: MultiModalConfig) -> ImageFront:
    """The API's image support for the model in `folder` under `config`'s policy."""
    return ImageFront(model_processor(folder), MediaPolicy.from_config(config))
