"""Tiny random-weight Qwen2-VL and Qwen2.5-VL folders, written like a hub checkout without any download.

`make_tiny_qwen_vl(arch, path)` saves the transformers model (float32), a tiny byte-level tokenizer with the Qwen
special tokens and a chat template that writes the image marker, and the (PIL) image processor's
preprocessor_config.json; `make_tiny_hf_qwen_vl` gives the transformers model itself, the tests' reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pagoda.server.testing.tiny_models import MODEL_VOCAB_SIZE, make_tiny_tokenizer
from tokenizers import Tokenizer, processors
from torch import nn
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

QWEN_VL_ARCHS = ("qwen2_vl", "qwen2_5_vl")
# Added after the trained vocabulary, in this order (ids VOCAB_SIZE, VOCAB_SIZE + 1, ...).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
IMAGE_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
# The smallest image the processor keeps as is: a 4 x 4 patch grid, 4 tokens once merged.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112

# Qwen's template: a role header per message, an image part as the marker, a text part (or plain string) as is.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_MARKER + "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_tokenizer(path: Path) -> dict[str, int]:
    """The tiny BPE tokenizer plus the Qwen special tokens (no BOS, like Qwen's); the special tokens' ids."""
    make_tiny_tokenizer(path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # Qwen adds no BOS/EOS
    tokenizer.save(str(path / "tokenizer.json"))
    ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        found = tokenizer.token_to_id(token)
        assert found is not None, token
        ids[token] = int(found)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids


# The benchmark's "small" model: head_dim 64 (vLLM's CPU attention needs 64 or more), 256 tokens for a 448 px
# image (as Qwen2-VL-2B gives), about 40M parameters.
SMALL_TEXT: dict[str, int] = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
SMALL_MROPE = [8, 12, 12]
SMALL_VISION: dict[str, int] = {"depth": 8, "num_heads": 4}
SMALL_MAX_PIXELS = 448 * 448


def tiny_qwen_vl_config(
    arch: str, token_ids: dict[str, int], *, small: bool = False
) -> Qwen2VLConfig | Qwen2_5_VLConfig:
    """The transformers config of a tiny (or the benchmark's small) `arch` model whose special tokens have
    `token_ids`."""
    text: dict[str, Any] = {
        "vocab_size": MODEL_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,  # head_dim 16
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        # Sums to head_dim / 2, uneven so that a wrong split of the three axes shows.
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "pad_token_id": token_ids["<|endoftext|>"],
    }
    vision: dict[str, Any] = {
        "depth": 2,
        "num_heads": 2,  # head_dim 16
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "in_channels": 3,
    }
    if small:
        text.update(SMALL_TEXT)
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": SMALL_MROPE}
        vision.update(SMALL_VISION)
    common: dict[str, Any] = {
        "text_config": text,
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "tie_word_embeddings": False,
    }
    if arch == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
        if small:
            vision.update(embed_dim=256, hidden_size=SMALL_TEXT["hidden_size"], mlp_ratio=4)
        return Qwen2VLConfig(vision_config=vision, **common)
    if arch == "qwen2_5_vl":
        # window_size 56 px = 2 x 2 merged tokens per window: an image over 56 px a side spans several windows;
        # block 0 attends within windows, block 1 over the whole image.
        vision.update(
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=64,
            window_size=56,
            fullatt_block_indexes=[1],
            hidden_act="silu",
        )
        if small:
            vision.update(
                hidden_size=256,
                intermediate_size=1024,
                out_hidden_size=SMALL_TEXT["hidden_size"],
                fullatt_block_indexes=[3, 7],
                window_size=112,
            )
        return Qwen2_5_VLConfig(vision_config=vision, **common)
    raise ValueError(f"unknown tiny arch {arch!r}; choose one of {QWEN_VL_ARCHS}")


def make_tiny_hf_qwen_vl(arch: str, token_ids: dict[str, int], *, small: bool = False) -> PreTrainedModel:
    """A tiny (or the benchmark's small) random transformers model (fixed seed, float32, eager attention), every
    weight non-trivial."""
    torch.manual_seed(0)
    config = tiny_qwen_vl_config(arch, token_ids, small=small)
    config._attn_implementation = "eager"
    for sub in (config.text_config, config.vision_config):
        assert isinstance(sub, PretrainedConfig)
        sub._attn_implementation = "eager"
    hf_model: PreTrainedModel
    if isinstance(config, Qwen2_5_VLConfig):
        hf_model = Qwen2_5_VLForConditionalGeneration(config)
    else:
        hf_model = Qwen2VLForConditionalGeneration(config)
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.dim() == 1:  # norm weights start at 1 and biases at 0: perturb them so they are tested
                param.add_(torch.randn_like(param) * 0.3)
            else:  # initializer_range 0.02 leaves logits near zero: widen so comparisons mean something
                param.mul_(5.0)
    return nn.Module.eval(hf_model)


def _write_preprocessor_config(path: Path, max_pixels: int = MAX_PIXELS) -> None:
    """The PIL image processor's settings, as the hub's preprocessor_config.json holds them."""
    config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "rescale_factor": 1 / 255,
        "min_pixels": MIN_PIXELS,
        "max_pixels": max_pixels,
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(config, indent=2))


def make_tiny_qwen_vl(arch: str, path: Path, *, small: bool = False) -> Path:
    """Write a tiny (or, `small`, the benchmark's) `arch` ("qwen2_vl" or "qwen2_5_vl") model folder to `path`."""
    if arch not in QWEN_VL_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {QWEN_VL_ARCHS}")
    path.mkdir(parents=True, exist_ok=True)
    token_ids = _write_tokenizer(path)
    make_tiny_hf_qwen_vl(arch, token_ids, small=small).save_pretrained(path)
    _write_preprocessor_config(path, SMALL_MAX_PIXELS if small else MAX_PIXELS)
    return path
