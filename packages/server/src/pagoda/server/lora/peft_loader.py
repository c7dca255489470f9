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
    # The folder's files as read (`fingerprint`): adapters with equal ones share `weights` (LoRAManager).
    source: tuple[int, ...] | None = None


def fingerprint(path: str) -> tuple[int, ...] | None:
    """(device, inode, size, mtime) of a folder's two files: equal for one folder under two names or spellings,
    different once a file is rewritten; None when they cannot be read (the load then fails as usual)."""
    try:
        stats = [(Path(path) / name).stat() for name in (CONFIG_FILE, WEIGHTS_FILE)]
    except OSError:
        return None
    return tuple(n for st in stats for n in (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


def _fail(request: LoRARequest, what: str) -> LoRAError:
    """The error of adapter `request`, naming its folder."""
    return LoRAError(f"LoRA adapter {request.lora_name!r} at {request.lora_path}: {what}", "lora_path")


# One text for a folder that is missing, not a folder, unreadable or without the two files: which of these it
# is would tell a caller what exists on the server's disk.
UNREADABLE = f"not a readable PEFT adapter folder (one holding {CONFIG_FILE} and {WEIGHTS_FILE})"


def _read_config(request: LoRARequest, folder: Path) -> dict[str, Any]:
    """adapter_config.json, checked for what the loader supports."""
    try:
        text = (folder / CONFIG_FILE).read_text(encoding="utf-8")
        if not (folder / WEIGHTS_FILE).is_file():
            raise OSError(WEIGHTS_FILE)
    except OSError as exc:
        raise _fail(request, UNREADABLE) from exc
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise _fail(request, f"{CONFIG_FILE} is not valid JSON") from exc
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
    _check_scales(request, config)
    return config


def _is_number(value: object) -> bool:
    """A finite JSON number (not a bool, a string or null)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_scales(request: LoRARequest, config: Mapping[str, Any]) -> None:
    """lora_alpha a number and alpha_pattern an object of numbers (else `_scale` could not compute)."""
    if not _is_number(config.get("lora_alpha", 8)):
        raise _fail(request, f"{CONFIG_FILE}: lora_alpha must be a number")
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise _fail(request, f"{CONFIG_FILE}: alpha_pattern must be an object of module name -> number")
    for pattern, value in patterns.items():
        if not _is_number(value):
            raise _fail(request, f"{CONFIG_FILE}: alpha_pattern[{pattern!r}] must be a number")


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


# safetensors' dtype names of the factor dtypes served (a header's, read before any data).
_HEADER_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def load_adapter(
    request: LoRARequest,
    targets: Mapping[str, Target],
    *,
    max_rank: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """Read and check `request`'s folder; this rank's factors of every target it adapts.

    Every name, dtype and shape in the safetensors header is checked against the base model before any tensor
    is read, so a header declaring a huge tensor is refused without allocating it. Any failure is a LoRAError.
    """
    folder = Path(request.lora_path)
    source = fingerprint(request.lora_path)
    config = _read_config(request, folder)
    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as tensors:
            shapes = _check_header(request, config, tensors, targets, max_rank)
            read = {
                module: {factor: tensors.get_tensor(key) for factor, key in keys.items()}
                for module, keys in shapes.items()
            }
    except LoRAError:
        raise
    except Exception as exc:  # a corrupt header, a truncated file: safetensors' own errors
        raise _fail(request, f"{WEIGHTS_FILE} is not a valid safetensors file") from exc
    weights = {
        module: _shard(config, module, factors, targets[module], dtype) for module, factors in read.items()
    }
    rank = max(int(w.a.shape[0]) for w in weights.values())
    return LoRAAdapter(request, rank, weights, source)


def _check_header(
    request: LoRARequest,
    config: Mapping[str, Any],
    tensors: Any,
    targets: Mapping[str, Target],
    max_rank: int,
) -> dict[str, dict[str, str]]:
    """Module -> {"lora_A": key, "lora_B": key} of the file, its header (names, dtypes, shapes) checked against
    the base projections; no tensor data is read."""
    keys: dict[str, dict[str, str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: set[str] = set()
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
        header = tensors.get_slice(key)
        dtypes.add(str(header.get_dtype()))
        shapes[key] = tuple(int(n) for n in header.get_shape())
        keys.setdefault(module, {})[factor] = key
    if not keys:
        raise _fail(request, f"{WEIGHTS_FILE} holds no lora_A / lora_B weights")
    if len(dtypes) > 1 or not dtypes <= set(_HEADER_DTYPES):
        raise _fail(
            request,
            f"dtype mismatch: its tensors are {', '.join(sorted(dtypes))}; one of F32, BF16 or F16 "
            "throughout is served (converted to the model's dtype)",
        )
    for module, factors in keys.items():
        if set(factors) != {"lora_A", "lora_B"}:
            raise _fail(request, f"{module} has only {', '.join(factors)}")
        _check_shapes(
            request, module, shapes[factors["lora_A"]], shapes[factors["lora_B"]], targets[module], max_rank
        )
    return keys


def _check_shapes(
    request: LoRARequest,
    module: str,
    a: tuple[int, ...],
    b: tuple[int, ...],
    target: Target,
    max_rank: int,
) -> None:
    """A [rank, in] and B [out, rank] as the header declares them, against the base projection and the cap."""
    if len(a) != 2 or len(b) != 2 or b[1] != a[0]:
        raise _fail(request, f"{module}: lora_A {a} and lora_B {b} do not pair")
    rank = a[0]
    if rank > max_rank:
        raise _fail(request, f"rank {rank} of {module} is above --max-lora-rank {max_rank}")
    if rank < 1 or a[1] != target.in_features or b[0] != target.out_features:
        raise _fail(
            request,
            f"{module}: lora_A {a} / lora_B {b} do not fit the base projection "
            f"[{target.out_features}, {target.in_features}] (another base model?)",
        )


def _shard(
    config: Mapping[str, Any],
    module: str,
    factors: Mapping[str, Tensor],
    target: Target,
    dtype: torch.dtype,
) -> LoRAWeights:
    """One target's A and B (shapes checked by `_check_shapes`), scaled and cut to this rank's shard."""
    a, b = factors["lora_A"], factors["lora_B"]  # [r, in], [out, r]
    b = b.float() * _scale(config, module, int(a.shape[0]))
    if target.rows is not None:
        b = b[target.rows.start : target.rows.start + target.rows.length]
    if target.cols is not None:
        a = a[:, target.cols.start : target.cols.start + target.cols.length]
    return LoRAWeights(a.to(dtype).contiguous(), b.to(dtype).contiguous())
