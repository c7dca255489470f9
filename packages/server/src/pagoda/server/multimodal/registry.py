"""Which `MultiModalProcessor` a model folder gets, by the architecture its config names."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

from pagoda.server.multimodal.processor import MultiModalProcessor
from pagoda.server.multimodal.processors.gemma3 import Gemma3Processor
from pagoda.server.multimodal.processors.llava import LlavaProcessor
from pagoda.server.multimodal.processors.qwen2_vl import Qwen2VLPromptProcessor
from transformers import PretrainedConfig

# Hugging Face architecture name -> the processor built from the model folder.
PROCESSORS: Mapping[str, Callable[[Path], MultiModalProcessor]] = MappingProxyType(
    {
        "Qwen2VLForConditionalGeneration": Qwen2VLPromptProcessor.from_folder,
        "Qwen2_5_VLForConditionalGeneration": Qwen2VLPromptProcessor.from_folder,
        "LlavaForConditionalGeneration": LlavaProcessor,
        "Gemma3ForConditionalGeneration": Gemma3Processor,
    }
)


def processor_for(model_path: Path, config: PretrainedConfig) -> MultiModalProcessor | None:
    """The folder's multimodal processor; None for a text-only model."""
    for arch in config.architectures or []:
        build = PROCESSORS.get(arch)
        if build is not None:
            return build(model_path)
    return None
