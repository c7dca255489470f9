"""Tiny PEFT LoRA adapters for the tiny models (needs `peft`, a dev dependency): random, non-zero A and B, so an
adapter changes the model's tokens; and the transformers + PEFT reference that loads them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_tiny_lora(
    base: Path,
    path: Path,
    *,
    rank: int = 8,
    alpha: int = 16,
    seed: int = 0,
    target_modules: Sequence[str] = ALL_TARGETS,
    scale: float = 0.5,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a PEFT LoRA folder for the model at `base` (`adapter_config.json`, `adapter_model.safetensors`)
    with every A and B drawn at random (PEFT starts B at zero, which would change nothing)."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale / param.shape[-1] ** 0.5)
    peft_model.to(dtype).save_pretrained(str(path))
    return path


def peft_reference(base: Path, adapter: Path) -> PreTrainedModel:
    """transformers' model at `base` with the adapter applied by `PeftModel.from_pretrained` (float32, eager)."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager", dtype=torch.float32)
    reference = PeftModel.from_pretrained(model, str(adapter)).eval()
    return cast(PreTrainedModel, reference)  # a PeftModel forwards generate and __call__ to the wrapped model


def greedy(model: PreTrainedModel, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """`max_tokens` greedy tokens after `prompt` (no eos stop), computed by the model itself."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = cast(Any, model).generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]
