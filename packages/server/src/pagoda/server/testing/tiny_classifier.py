"""Tiny random-weight cross-encoders: `*ForSequenceClassification` models of the Llama, Qwen2 and Qwen3 tiny
configs (one label unless told), saved with the tiny tokenizer like a hub checkout, for /score and /rerank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pagoda.server.testing.tiny_models import make_tiny_tokenizer, tiny_config
from torch import nn
from transformers import (
    LlamaForSequenceClassification,
    PreTrainedModel,
    Qwen2ForSequenceClassification,
    Qwen3ForSequenceClassification,
)

CLASSIFIER_ARCHS = ("llama", "qwen2", "qwen3")
_HF_CLASSES: dict[str, Callable[[Any], PreTrainedModel]] = {
    "llama": LlamaForSequenceClassification,
    "qwen2": Qwen2ForSequenceClassification,
    "qwen3": Qwen3ForSequenceClassification,
}


def make_tiny_hf_classifier(arch: str, **overrides: Any) -> PreTrainedModel:
    """A tiny random transformers cross-encoder of `arch` (one of CLASSIFIER_ARCHS; fixed seed, float32, eager
    attention, num_labels 1 unless `overrides` say), its norm weights perturbed so that they are tested."""
    torch.manual_seed(0)
    config = tiny_config(arch, **{"num_labels": 1, **overrides})
    config._attn_implementation = "eager"
    model = _HF_CLASSES[arch](config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.3)
    return nn.Module.eval(model)


def make_tiny_classifier(arch: str, path: Path, **overrides: Any) -> Path:
    """Write a tiny `arch` cross-encoder folder (config, safetensors with its `score` head, tokenizer) to `path`."""
    path.mkdir(parents=True, exist_ok=True)
    make_tiny_hf_classifier(arch, **overrides).save_pretrained(path)
    make_tiny_tokenizer(path)
    return path
