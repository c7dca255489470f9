"""Which `MultiModalProcessor` a model folder gets, by the architecture its config names."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from pagoda.server.multimodal.processor import MultiModalProcessor

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The processors import transformers' processing modules (1.6 s): each is imported when a folder needs it, so a
# text model's start pays nothing for them.


def _qwen2_vl(path: Path) -> MultiModalProcessor:
    from pagoda.server.multimodal.processors.qwen2_vl import Qwen2VLPromptProcessor

    return Qwen2VLPromptProcessor.from_folder(path)


def _llava(path: Path) -> MultiModalProcessor:
    from pagoda.server.multimodal.processors.llava import LlavaProcessor

    return LlavaProcessor(path)


def _gemma3(path: Path) -> MultiModalProcessor:
    from pagoda.server.multimodal.processors.gemma3 import Gemma3Processor

    return Gemma3Processor(path)


# Hugging Face architecture name -> the processor built from the model folder.
PROCESSORS: Mapping[str, Callable[[Path], MultiModalProcessor]] = MappingProxyType(
    {
        "Qwen2VLForConditionalGeneration": _qwen2_vl,
        "Qwen2_5_VLForConditionalGeneration": _qwen2_vl,
        "LlavaForConditionalGeneration": _llava,
        "Gemma3ForConditionalGeneration": _gemma3,
    }
)


def processor_for(model_path: Path, config: PretrainedConfig) -> MultiModalProcessor | None:
    """The folder's multimodal processor; None for a text-only model."""
    for arch in config.architectures or []:
        build = PROCESSORS.get(arch)
        if build is not None:
            return build(model_path)
    return None
