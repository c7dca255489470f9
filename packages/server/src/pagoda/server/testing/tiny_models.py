"""Tiny random-weight Hugging Face models of every supported architecture, with a real (tiny) tokenizer.

`make_tiny_model(arch, path)` writes a model folder exactly like a hub checkout (config.json, safetensors,
tokenizer files with a chat template) without any download; `tiny_config` and `make_tiny_hf_model` give the
transformers config and model it saves, the reference the tests compare Pagoda's models with.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch import nn
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHS = ("llama", "llama3_rope_scaling", "mistral", "qwen2", "qwen3", "gemma3")
VOCAB_SIZE = 384  # tokenizer
# The model's vocabulary is padded past the tokenizer's, as real checkpoints often are (and some AutoTokenizer
# classes add a token of their own: Qwen2Tokenizer appends <|endoftext|>).
MODEL_VOCAB_SIZE = 400
SLIDING_WINDOW = 8  # smaller than the test prompts, so that the window really cuts keys off
PAD, BOS, EOS = "<pad>", "<s>", "</s>"

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A paged cache splits every sequence into fixed blocks. "
    "Continuous batching lets requests join and leave the running batch at every step of the engine. "
    "The capital of France is Paris, and the capital of Italy is Rome. Small models answer quickly. "
    "Attention reads keys and values of earlier tokens; a sliding window only reads the most recent ones. "
    "Hello world! How are you today? I am fine, thank you. Tokens, blocks, tables and slots."
)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_tokenizer(path: Path) -> None:
    """Train a byte-level BPE tokenizer (VOCAB_SIZE tokens, pad/bos/eos, a chat template) and save it to `path`.

    Saved as a `tokenizer.json` plus a `tokenizer_config.json`, the files AutoTokenizer reads from a hub checkout.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """The Hugging Face config of a tiny model of `arch` (one of ARCHS); `overrides` replace its fields."""
    common: dict[str, Any] = {
        "vocab_size": MODEL_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "initializer_range": 0.15,  # large enough that logits are O(1) and the comparisons mean something
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    if arch == "llama":
        config: PretrainedConfig = LlamaConfig(**{**common, **overrides})
    elif arch == "llama3_rope_scaling":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # Small, so that the tiny head_dim has low, medium and high frequencies (all three branches).
            "original_max_position_embeddings": 64,
        }
        config = LlamaConfig(**{**common, "tie_word_embeddings": True, "rope_parameters": rope, **overrides})
    elif arch == "mistral":
        config = MistralConfig(**{**common, "sliding_window": SLIDING_WINDOW, **overrides})
    elif arch == "qwen2":
        # The window applies from layer max_window_layers on: layer 0 full, layer 1 sliding.
        qwen2 = {"use_sliding_window": True, "sliding_window": SLIDING_WINDOW, "max_window_layers": 1}
        config = Qwen2Config(**{**common, **qwen2, **overrides})
    elif arch == "qwen3":
        config = Qwen3Config(**{**common, "head_dim": 24, **overrides})  # heads * head_dim != hidden
    elif arch == "gemma3":
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        }
        gemma3 = {
            "num_hidden_layers": 3,
            "head_dim": 32,  # heads * head_dim != hidden_size, as in the real model (4 x 256 vs 640)
            "query_pre_attn_scalar": 24,  # != head_dim, so a wrong attention scale shows
            "sliding_window": SLIDING_WINDOW,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": rope,
            "final_logit_softcapping": 2.0,  # small, so the cap bends the tiny model's logits
            "tie_word_embeddings": True,
        }
        config = Gemma3TextConfig(**{**common, **gemma3, **overrides})
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {ARCHS}")
    return config


_HF_CLASSES: dict[str, Callable[[Any], PreTrainedModel]] = {
    "llama": LlamaForCausalLM,
    "llama3_rope_scaling": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def make_tiny_hf_model(arch: str, **overrides: Any) -> PreTrainedModel:
    """A tiny random Hugging Face model (fixed seed, float32, eager attention) with every weight non-trivial."""
    torch.manual_seed(0)
    config = tiny_config(arch, **overrides)
    config._attn_implementation = "eager"
    hf_model = _HF_CLASSES[arch](config)  # float32, the default dtype
    with torch.no_grad():
        # Norm weights start at 1 (or 0 for Gemma's 1 + w) and biases at 0: perturb them so they are tested.
        for param in hf_model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.3)
    return nn.Module.eval(hf_model)


def make_tiny_model(arch: str, path: Path, **overrides: Any) -> Path:
    """Write a tiny `arch` model folder (config, safetensors, tokenizer with chat template) to `path`."""
    path.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {}
    if "max_shard_size" in overrides:
        save_kwargs["max_shard_size"] = overrides.pop("max_shard_size")
    make_tiny_hf_model(arch, **overrides).save_pretrained(path, **save_kwargs)
    make_tiny_tokenizer(path)
    return path
