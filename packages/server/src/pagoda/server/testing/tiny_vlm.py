"""Tiny random-weight vision-language models (Llava, Gemma 3) with a real tiny tokenizer and image processor.

`make_tiny_vlm(arch, path)` writes a folder like a hub checkout (config, safetensors, tokenizer with the image
special tokens and a chat template that writes the image marker, image processor and processor configs) without
any download; `make_tiny_hf_vlm(arch)` is the transformers model it saves, the tests' reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pagoda.server.testing.tiny_models import BOS, EOS, PAD, VOCAB_SIZE, make_tiny_tokenizer, tiny_config
from tokenizers import AddedToken, Tokenizer
from torch import nn
from transformers import (
    AutoTokenizer,
    CLIPVisionConfig,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedModel,
    ProcessorMixin,
    SiglipVisionConfig,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

VLM_ARCHS = ("llava", "gemma3_vl")
# What the chat template writes for an image content part.
IMAGE_MARKERS = {"llava": "<image>", "gemma3_vl": "<start_of_image>"}
# The image special tokens each tokenizer adds (ids VOCAB_SIZE on, inside the model's padded vocabulary).
_SPECIAL_TOKENS = {
    "llava": ["<image>"],
    "gemma3_vl": ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
}
LLAVA_IMAGE_SIZE = 28  # 4 x 4 patches of 7: 16 image tokens (CLS dropped)
GEMMA3_IMAGE_SIZE = 56  # 8 x 8 patches of 7, pooled 2 x 2: 16 image tokens
PATCH_SIZE = 7
GEMMA3_TOKENS_PER_IMAGE = 16


def _vision_common() -> dict[str, Any]:
    """The vision tower fields both tiny models share."""
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "patch_size": PATCH_SIZE,
        "num_channels": 3,
    }


def _chat_template(marker: str) -> str:
    """A chat template writing `marker` for image parts, the text of text parts, and plain string content."""
    return (
        "{% for message in messages %}<|{{ message['role'] }}|>"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{marker}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


# The benchmark's "small" Llava: a 224 px CLIP of 14 px patches (256 image tokens, as LLaVA-1.5 at 336 px has
# 576) before a Llama of head_dim 64 (vLLM's CPU attention needs 64 or more); about 40M parameters.
SMALL_LLAVA_IMAGE_SIZE = 224
SMALL_LLAVA_VISION: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "patch_size": 14,
    "num_channels": 3,
}
SMALL_LLAVA_TEXT: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
}


def tiny_llava_config(*, small: bool = False, **overrides: Any) -> LlavaConfig:
    """The tiny (or the benchmark's small) Llava: CLIP (quick_gelu, features of the second-to-last layer, CLS
    dropped), tiny Llama."""
    text = tiny_config(
        "llama", **(SMALL_LLAVA_TEXT if small else {})
    )  # tiny: hidden 64, 4 heads, head_dim 16
    vision = CLIPVisionConfig(
        **(SMALL_LLAVA_VISION if small else _vision_common()),
        image_size=SMALL_LLAVA_IMAGE_SIZE if small else LLAVA_IMAGE_SIZE,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    )
    patches = (SMALL_LLAVA_IMAGE_SIZE // 14) ** 2 if small else (LLAVA_IMAGE_SIZE // PATCH_SIZE) ** 2
    fields: dict[str, Any] = {
        "vision_config": vision,
        "text_config": text,
        "image_token_id": _token_id("llava", "<image>"),
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "image_seq_length": patches,
        "tie_word_embeddings": False,
    }
    return LlavaConfig(**{**fields, **overrides})


def tiny_gemma3_vl_config() -> Gemma3Config:
    """The tiny Gemma 3 VLM: SigLIP (no pooling head), 8 x 8 patches pooled to 16 tokens, tiny Gemma 3 text."""
    # A window wider than the test prompts: bidirectional images are exact there (see image_attention).
    text = tiny_config("gemma3", sliding_window=512)
    gemma_vision = SiglipVisionConfig(
        **_vision_common(),
        image_size=GEMMA3_IMAGE_SIZE,
        hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=1e-6,
        vision_use_head=False,  # as Gemma 3's: it reads the patch states
    )
    return Gemma3Config(
        vision_config=gemma_vision,
        text_config=text,
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
        boi_token_index=_token_id("gemma3_vl", "<start_of_image>"),
        eoi_token_index=_token_id("gemma3_vl", "<end_of_image>"),
        image_token_index=_token_id("gemma3_vl", "<image_soft_token>"),
        tie_word_embeddings=True,
    )


def _token_id(arch: str, token: str) -> int:
    """The id the tiny tokenizer gives an image special token: appended after the trained vocabulary."""
    return VOCAB_SIZE + _SPECIAL_TOKENS[arch].index(token)


def make_tiny_hf_vlm(arch: str, *, small: bool = False, **overrides: Any) -> PreTrainedModel:
    """The tiny (or, `small`, the benchmark's Llava) random transformers model of `arch` (fixed seed, float32,
    eager attention), every weight non-trivial; `overrides` replace top-level fields of the Llava config (e.g.
    vision_feature_layer)."""
    torch.manual_seed(0)
    model: PreTrainedModel
    if arch == "llava":
        model = LlavaForConditionalGeneration(tiny_llava_config(small=small, **overrides))
    elif arch == "gemma3_vl":
        model = Gemma3ForConditionalGeneration(tiny_gemma3_vl_config())
    else:
        raise ValueError(f"unknown tiny VLM arch {arch!r}; choose one of {VLM_ARCHS}")
    model.set_attn_implementation("eager")
    with torch.no_grad():
        # Norms start at 1 (Gemma's 1 + w at 0), biases and the Gemma 3 projection at 0: perturb them.
        for name, param in model.named_parameters():
            if param.dim() == 1 or "mm_input_projection_weight" in name:
                param.add_(torch.randn_like(param) * 0.3)
    return nn.Module.eval(model)


def _write_tokenizer(arch: str, path: Path) -> None:
    """The tiny tokenizer plus the image special tokens, with a chat template writing the image marker."""
    make_tiny_tokenizer(path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in _SPECIAL_TOKENS[arch]])
    for token in _SPECIAL_TOKENS[arch]:
        assert tokenizer.token_to_id(token) == _token_id(arch, token), token
    tokenizer.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "chat_template": _chat_template(IMAGE_MARKERS[arch]),
    }
    if arch == "llava":
        config["extra_special_tokens"] = {"image_token": "<image>"}
    else:
        config["extra_special_tokens"] = {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _processor(arch: str, path: Path, strategy: str, small: bool = False) -> ProcessorMixin:
    """The transformers processor of the tiny (or small) `arch` model, over the tokenizer saved in `path`."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    template = _chat_template(IMAGE_MARKERS[arch])
    if arch == "llava":
        size = SMALL_LLAVA_IMAGE_SIZE if small else LLAVA_IMAGE_SIZE
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        )
        llava: ProcessorMixin = LlavaProcessor(  # type: ignore[no-untyped-call]
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=14 if small else PATCH_SIZE,
            vision_feature_select_strategy=strategy,
            num_additional_image_tokens=1,  # CLIP's CLS token, which the "default" strategy drops
            chat_template=template,
        )
        return llava
    size = GEMMA3_IMAGE_SIZE
    gemma_images = Gemma3ImageProcessorPil(size={"height": size, "width": size})
    return Gemma3Processor(
        image_processor=gemma_images,
        tokenizer=tokenizer,
        chat_template=template,
        image_seq_length=GEMMA3_TOKENS_PER_IMAGE,
    )


def make_tiny_vlm(arch: str, path: Path, *, small: bool = False, **overrides: Any) -> Path:
    """Write the tiny (or, `small`, the benchmark's Llava) `arch` model folder (config, safetensors, tokenizer,
    processor configs) to `path`; `overrides`: see `make_tiny_hf_vlm`."""
    if small and arch != "llava":
        raise ValueError("the small size exists for llava only")
    path.mkdir(parents=True, exist_ok=True)
    make_tiny_hf_vlm(arch, small=small, **overrides).save_pretrained(path)
    _write_tokenizer(arch, path)
    strategy = str(overrides.get("vision_feature_select_strategy", "default"))
    _processor(arch, path, strategy, small).save_pretrained(path)
    return path
