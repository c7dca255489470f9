"""Pick and build the model class for a Hugging Face config."""

from __future__ import annotations

from types import MappingProxyType

import torch
from pagoda.server.models.base import CausalLM
from pagoda.server.models.gemma3 import Gemma3ForCausalLM
from pagoda.server.models.gemma3_mm import Gemma3ForConditionalGeneration
from pagoda.server.models.llama import LlamaForCausalLM, LlamaForSequenceClassification
from pagoda.server.models.llava import LlavaForConditionalGeneration
from pagoda.server.models.parallel import ParallelGroup, check_tensor_parallel
from pagoda.server.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from transformers import PretrainedConfig

# Hugging Face architecture name -> (model_type, implementation).
ARCHITECTURES: MappingProxyType[str, tuple[str, type[CausalLM]]] = MappingProxyType(
    {
        "LlamaForCausalLM": ("llama", LlamaForCausalLM),
        "MistralForCausalLM": ("mistral", LlamaForCausalLM),
        "Qwen2ForCausalLM": ("qwen2", LlamaForCausalLM),
        "Qwen3ForCausalLM": ("qwen3", LlamaForCausalLM),
        "Gemma3ForCausalLM": ("gemma3_text", Gemma3ForCausalLM),
        # Vision-language models: a vision tower and projector before the text decoder (multimodal/registry.py
        # names their processors).
        "Qwen2VLForConditionalGeneration": ("qwen2_vl", Qwen2VLForConditionalGeneration),
        "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", Qwen2_5_VLForConditionalGeneration),
        "LlavaForConditionalGeneration": ("llava", LlavaForConditionalGeneration),
        "Gemma3ForConditionalGeneration": ("gemma3", Gemma3ForConditionalGeneration),
        # Cross-encoders (the pooling runner's /score and /rerank): the decoder with a `score` head.
        "LlamaForSequenceClassification": ("llama", LlamaForSequenceClassification),
        "Qwen2ForSequenceClassification": ("qwen2", LlamaForSequenceClassification),
        "Qwen3ForSequenceClassification": ("qwen3", LlamaForSequenceClassification),
    }
)


class UnsupportedArchitectureError(ValueError):
    """The config names a model architecture that Pagoda does not implement."""


def supported_architectures() -> list[str]:
    """The architecture names `build_model` accepts, with their model_type."""
    return [f"{arch} ({model_type})" for arch, (model_type, _) in ARCHITECTURES.items()]


def model_class(hf_config: PretrainedConfig) -> type[CausalLM]:
    """The implementation for a config, chosen by `architectures` and else by `model_type`."""
    for arch in hf_config.architectures or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch][1]
    by_type: dict[str, type[CausalLM]] = {}
    for model_type, cls in ARCHITECTURES.values():  # a config without architectures is a causal LM's
        by_type.setdefault(model_type, cls)
    if not hf_config.architectures and hf_config.model_type in by_type:
        return by_type[hf_config.model_type]
    raise UnsupportedArchitectureError(
        f"unsupported model: architectures={hf_config.architectures}, model_type={hf_config.model_type!r}; "
        f"supported: {', '.join(supported_architectures())}"
    )


def build_model(
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    group: ParallelGroup | None = None,
) -> CausalLM:
    """An inference-mode model for the config (this rank's shard of it), its parameters allocated on `device` but
    not yet loaded; TensorParallelError when the group's size cannot split its heads."""
    size = 1 if group is None else group.size
    check_tensor_parallel(hf_config.get_text_config(), size)
    model = model_class(hf_config)(hf_config, dtype=dtype, device=device, group=group)
    return model.requires_grad_(False).eval()
