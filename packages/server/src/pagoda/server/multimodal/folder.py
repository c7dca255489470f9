"""The multimodal processor of a model folder, found once at start-up (the server's API, the offline `LLM`)."""

from __future__ import annotations

from pathlib import Path

from pagoda.server.multimodal.processor import MultiModalProcessor
from pagoda.server.multimodal.registry import processor_for


def model_processor(folder: str | Path) -> MultiModalProcessor | None:
    """The multimodal processor of a Hugging Face model folder, by its config's architecture; None for a text-only
    model, or for a model that is no such folder (a GGUF file, a packaged model)."""
    path = Path(folder)
    if not (path / "config.json").is_file():
        return None
    from transformers import AutoConfig  # seconds to import: only once a folder is known

    return processor_for(path, AutoConfig.from_pretrained(path))
