"""Load a model for the engine: a Hugging Face safetensors folder, a .gguf file, or a packaged model by short name
(`pagoda.server.packaged`; None is the default one)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from pagoda.pagedkernel.quant import GGMLType, QuantBackendName
from pagoda.server.loader.default import DEFAULT_MODEL_NAME, PackagedModelMissingError, packaged_model_folder
from pagoda.server.loader.gguf import (
    CACHE_DIR_ENV,
    UntrustedCacheError,
    cache_folder,
    convert_gguf,
    default_cache_root,
)
from pagoda.server.loader.gguf_check import GGUFFileError
from pagoda.server.loader.quantize_at_load import quantize_weights
from pagoda.server.loader.weights import WeightLoadError, load_safetensors, safetensors_files
from pagoda.server.models import CausalLM, ParallelGroup, build_model
from pagoda.server.packaged import packaged_model
from pagoda.server.startup import log_phase
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

__all__ = [
    "CACHE_DIR_ENV",
    "DEFAULT_MODEL_NAME",
    "GGUFFileError",
    "LoadedModel",
    "PackagedModelMissingError",
    "UntrustedCacheError",
    "WeightLoadError",
    "cache_folder",
    "convert_gguf",
    "default_cache_root",
    "load_model",
    "load_shard",
    "resolve_model_folder",
    "resolve_tokenizer_folder",
]


@dataclass(frozen=True)
class LoadedModel:
    """A model with its weights loaded, its Hugging Face config and tokenizer, and the folder they came from."""

    model: CausalLM
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    model_path: Path


def resolve_model_folder(model: str | None, cache_dir: Path | None = None) -> Path:
    """The safetensors model folder for `model`: None = the default model, a packaged model's short name (looked
    up first), a folder, or a .gguf file (converted)."""
    if model is None or packaged_model(model) is not None:
        return packaged_model_folder(model, cache_dir)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"{model!r} is neither a model folder (config.json + safetensors), a .gguf file nor a packaged model's "
        "short name (Pagoda loads local files only and never downloads from a hub)"
    )


def resolve_tokenizer_folder(tokenizer: str) -> Path:
    """The folder of a `--tokenizer` path: tokenizer files without a model, as vLLM's `--tokenizer` takes."""
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return path
    raise FileNotFoundError(
        f"tokenizer {tokenizer!r} is not a folder of tokenizer files (Pagoda loads local files only and never "
        "downloads from a hub)"
    )


def _load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a folder (its own start-up phase in the log)."""
    start = time.perf_counter()
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(folder)
    log_phase("tokenizer", start)
    return tokenizer


def load_shard(
    folder: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    group: ParallelGroup | None = None,
    keep_quantized: bool = True,
    quant_backend: QuantBackendName = "auto",
    quantize_to: GGMLType | None = None,
    hf_config: PretrainedConfig | None = None,
    before_copies: Callable[[], None] | None = None,
) -> tuple[CausalLM, PretrainedConfig]:
    """The model of a safetensors folder, this rank's shard only (each tensor read slice by slice), and its config;
    a converted GGUF's block-format weights stay quantized with `keep_quantized` (see `load_safetensors`), and
    `quantize_to` quantizes the dense ones at load into that block format (`quantize_weights`). `hf_config`: the
    folder's config when the caller read it already; `before_copies`: see `load_safetensors`."""
    hf_config = hf_config or AutoConfig.from_pretrained(folder)
    built = build_model(hf_config, dtype, device, group)
    load_safetensors(
        built,
        safetensors_files(folder),
        keep_quantized=keep_quantized,
        quant_backend=quant_backend,
        before_copies=before_copies,
    )
    if quantize_to is not None:
        quantize_weights(built, quantize_to, quant_backend)
    return built, hf_config


def load_model(
    model: str | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    cache_dir: Path | None = None,
    tokenizer: str | None = None,
    group: ParallelGroup | None = None,
    keep_quantized: bool = True,
    quant_backend: QuantBackendName = "auto",
    quantize_to: GGMLType | None = None,
) -> LoadedModel:
    """Load `model` (see `resolve_model_folder`) onto `device` in `dtype`, with its config and tokenizer.

    The tokenizer comes from the `tokenizer` folder when given, else from the model's folder. Every parameter
    must come from the checkpoint (`WeightLoadError` otherwise); an unsupported architecture raises
    `UnsupportedArchitectureError` listing the supported ones. With a `group` of several ranks, the model is
    this rank's shard. A .gguf's weights keep their block formats with `keep_quantized` (else dequantized).
    """
    # Resolved first: a wrong tokenizer path fails before seconds of weight loading, not after.
    tokenizer_folder = None if tokenizer is None else resolve_tokenizer_folder(tokenizer)
    folder = resolve_model_folder(model, cache_dir)
    # The config first, on this thread: the tokenizer's thread then finds transformers' modules imported.
    hf_config = AutoConfig.from_pretrained(folder)
    # The tokenizer is read while the weights are copied: its 1-1.5 s (Gemma 3's 262k vocabulary; JSON parsing and
    # Rust that hold the GIL throughout) beside the weights' bulk copy, which holds none. It starts once the
    # weights' own Python work is done (`before_copies`), which would otherwise wait for the GIL behind it.
    tokenizer_future: Future[PreTrainedTokenizerBase] | None = None
    with ThreadPoolExecutor(1, thread_name_prefix="pagoda-tokenizer-load") as pool:

        def start_tokenizer() -> None:
            nonlocal tokenizer_future
            if tokenizer_future is None:
                tokenizer_future = pool.submit(_load_tokenizer, tokenizer_folder or folder)

        start = time.perf_counter()
        built, hf_config = load_shard(
            folder,
            dtype=dtype,
            device=device,
            group=group,
            keep_quantized=keep_quantized,
            quant_backend=quant_backend,
            quantize_to=quantize_to,
            hf_config=hf_config,
            before_copies=start_tokenizer,
        )
        log_phase("weights", start)
        start_tokenizer()  # a model without quantized blocks had no bulk copy
        assert tokenizer_future is not None
        loaded_tokenizer = tokenizer_future.result()
    return LoadedModel(model=built, hf_config=hf_config, tokenizer=loaded_tokenizer, model_path=folder)
