"""Reading a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) into per-target A and B.

Targets are the decoder layers' projections, the embedding (PEFT's `lora_embedding_A` [r, vocab] / `_B`
[dim, r]) and the LM head, tied or not (a LoRA on the logits only, as PEFT applies it). Each target's scale (lora_alpha / r, or / sqrt(r) with use_rslora; per module with rank_pattern / alpha_pattern)
is folded into B, so the op runs with unit scales. TP: B keeps the rows of this rank's output shard, A the
columns of its input shard, exactly as the base weights are split (`targets.Target`). Every error is a LoRAError
naming the request field (`lora_path`) and saying what is wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pagoda.server.lora.request import LoRAError, LoRARequest
from pagoda.server.lora.targets import EMBEDDING, LM_HEAD, Target
from safetensors import safe_open
from torch import Tensor

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One target's factors on this rank, in the engine's dtype, scale folded into b."""

    a: Tensor  # [rank, in_features of this rank]
    b: Tensor  # [out_features of this rank, rank]


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """A loaded adapter: its request and its factors by checkpoint module name (CPU tensors)."""

    request: LoRARequest
    rank: int  # the largest rank of its targets
    weights: Mapping[str, LoRAWeights]


def _fail(request: LoRARequest, what: str) -> LoRAError:
    """The error of adapter `request`, naming its folder."""
    return LoRAError(f"LoRA adapter {request.lora_name!r} at {request.lora_path}: {what}", "lora_path")


def _read_config(request: LoRARequest, folder: Path) -> dict[str, Any]:
    """adapter_config.json, checked for what the loader supports."""
    if not folder.is_dir():
        raise _fail(request, "no such folder")
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise _fail(request, f"a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _fail(request, f"{CONFIG_FILE} is not readable JSON ({exc})") from exc
    if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise _fail(request, f"{CONFIG_FILE} is not a LoRA adapter's (peft_type must be LORA)")
    if config.get("fan_in_fan_out"):
        raise _fail(request, "fan_in_fan_out adapters (Conv1D bases) are not supported")
    if config.get("use_dora"):
        raise _fail(request, "DoRA adapters (use_dora) are not supported")
    if config.get("modules_to_save"):
        modules = ", ".join(map(str, config["modules_to_save"]))
        raise _fail(
            request, f"modules_to_save ({modules}: fully trained copies of base modules) is not supported"
        )
    if config.get("trainable_token_indices"):
        raise _fail(
            request,
            f"trainable_token_indices (new-token embeddings of {config['trainable_token_indices']}) is not supported",
        )
    return config


def _scale(config: Mapping[str, Any], module: str, rank: int) -> float:
    """The module's scaling: its alpha over its rank (rsLoRA: over the rank's square root)."""
    alpha = float(config.get("lora_alpha", 8))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if module == pattern or module.endswith("." + str(pattern)):
            alpha = float(value)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


# PEFT's factor names: a Linear's lora_A.weight / lora_B.weight, an Embedding's lora_embedding_A / _B parameters.
_FACTORS = {
    ".lora_A.weight": ("lora_A", False),
    ".lora_B.weight": ("lora_B", False),
    ".lora_embedding_A": ("lora_A", True),
    ".lora_embedding_B": ("lora_B", True),
}
_BASE_COPY = ".base_layer.weight"  # PEFT saves the base embedding / LM head whenever an adapter targets one


def _split_key(request: LoRARequest, key: str) -> tuple[str, str, bool] | None:
    """(checkpoint module name, "lora_A" or "lora_B", whether an embedding's factor) of a safetensors key; None
    for PEFT's saved copy of a base embedding or LM head (checked by `_check_base_copy`)."""
    name = key.removeprefix(_PREFIX)
    for suffix, (factor, embedding) in _FACTORS.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix), factor, embedding
    if name.endswith(_BASE_COPY) and name.removesuffix(_BASE_COPY) in (EMBEDDING, LM_HEAD):
        return None
    if "trainable_tokens" in name or "token_adapter" in name:
        raise _fail(request, f"new-token embeddings ({key}, trainable tokens) are not supported")
    raise _fail(request, f"unexpected tensor {key} (only LoRA factors are supported)")


def _check_base_copy(request: LoRARequest, key: str, shape: tuple[int, ...], target: Target) -> None:
    """PEFT's copy of the base embedding or LM head must be the base's shape: another vocabulary size means the
    adapter was trained with new tokens (a resized embedding), which would need those rows served too."""
    module = key.removeprefix(_PREFIX).removesuffix(_BASE_COPY)
    vocab, hidden = (target.in_features, target.out_features)
    if target.kind == "head":
        vocab, hidden = hidden, vocab
    if shape != (vocab, hidden):
        raise _fail(
            request,
            f"{module}: its saved base weight is {list(shape)}, the model's [{vocab}, {hidden}] (an adapter "
            "trained with new-token embeddings or a resized vocabulary is not supported)",
        )


def load_adapter(
    request: LoRARequest,
    targets: Mapping[str, Target],
    *,
    max_rank: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """Read and check `request`'s folder; this rank's factors of every target it adapts."""
    folder = Path(request.lora_path)
    config = _read_config(request, folder)
    pairs: dict[str, dict[str, Tensor]] = {}
    dtypes: set[torch.dtype] = set()
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as tensors:
        for key in tensors.keys():  # noqa: SIM118 (safe_open has keys(), not __iter__)
            split = _split_key(request, key)
            if split is None:
                base = key.removeprefix(_PREFIX).removesuffix(_BASE_COPY)
                if base in targets:
                    _check_base_copy(request, key, tuple(tensors.get_slice(key).get_shape()), targets[base])
                continue
            module, factor, embedding = split
            if module not in targets:
                raise _fail(
                    request,
                    f"target module {module} is not a projection of this model (target_modules "
                    f"{config.get('target_modules')}); adaptable: q/k/v/o_proj, gate/up/down_proj, "
                    "embed_tokens and lm_head",
                )
            if embedding != (targets[module].kind == "embedding"):
                what = "an Embedding's" if embedding else "a Linear's"
                raise _fail(request, f"{key} is {what} factor, which {module} of this model is not")
            tensor = tensors.get_tensor(key)
            dtypes.add(tensor.dtype)
            pairs.setdefault(module, {})[factor] = tensor
    if not pairs:
        raise _fail(request, f"{WEIGHTS_FILE} holds no lora_A / lora_B weights")
    bad = sorted(str(d) for d in dtypes if d not in _FLOAT_DTYPES)
    if bad or len(dtypes) > 1:
        raise _fail(
            request,
            f"dtype mismatch: its tensors are {', '.join(sorted(map(str, dtypes)))}; one of float32, "
            f"bfloat16 or float16 throughout is served (converted to the model's {dtype})",
        )
    weights: dict[str, LoRAWeights] = {}
    rank = 0
    for module, factors in pairs.items():
        if set(factors) != {"lora_A", "lora_B"}:
            raise _fail(request, f"{module} has only {', '.join(factors)}")
        weights[module] = _shard(request, config, module, factors, targets[module], max_rank, dtype)
        rank = max(rank, int(weights[module].a.shape[0]))
    return LoRAAdapter(request, rank, weights)


def _shard(
    request: LoRARequest,
    config: Mapping[str, Any],
    module: str,
    factors: Mapping[str, Tensor],
    target: Target,
    max_rank: int,
    dtype: torch.dtype,
) -> LoRAWeights:
    """One target's A and B checked against the base projection, scaled and cut to this rank's shard."""
    a, b = factors["lora_A"], factors["lora_B"]  # [r, in], [out, r]
    rank = int(a.shape[0])
    if rank > max_rank:
        raise _fail(request, f"rank {rank} of {module} is above --max-lora-rank {max_rank}")
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
        raise _fail(request, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not pair")
    if a.shape[1] != target.in_features or b.shape[0] != target.out_features:
        raise _fail(
            request,
            f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base projection "
            f"[{target.out_features}, {target.in_features}] (another base model?)",
        )
    b = b.float() * _scale(config, module, rank)
    if target.rows is not None:
        b = b[target.rows.start : target.rows.start + target.rows.length]
    if target.cols is not None:
        a = a[:, target.cols.start : target.cols.start + target.cols.length]
    return LoRAWeights(a.to(dtype).contiguous(), b.to(dtype).contiguous())
