"""GGUF files: converted once through transformers' GGUF reader, cached as a safetensors model folder.

The cache keeps each weight in the block format the file stores it in (uint8 rows, see `quantized_cache`) where
the quantized ops support that format, and float32 elsewhere.

A cached folder is loaded as the model (weights, tokenizer, chat template), and its name is predictable, so the
cache follows the kernel cache's rules (`pagoda.pagedkernel.cbuild`): the root and each folder are 0700, and a
root or a cached folder (or a file in it) that is a symlink, owned by another user or writable by others is never
used: `UntrustedCacheError` names it and says what to do. A file is only converted once its header passed
`check_gguf_file` (a crafted file is a `GGUFFileError`, before transformers reads it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from pagoda.pagedkernel.cbuild import UnsafeCacheError, check_private, make_dirs_private
from pagoda.server.loader.gguf_check import check_gguf_file
from pagoda.server.loader.quantized_cache import quantized_state
from pagoda.server.loader.weights import SAFETENSORS_SINGLE
from safetensors.torch import save_file
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "PAGODA_CACHE_DIR"
# Part of every cache key: bump it when the conversion writes something different, so old caches are redone.
_CACHE_FORMAT = 4  # 4: GGUF blocks kept as stored (3 was float32 throughout)
# Gemma's chat turns end with this token. Google's generation_config.json lists it beside <eos>, but llama.cpp's
# Gemma GGUF files keep <eos> only, so a converted chat model would not stop at the end of its turn.
_GEMMA_END_OF_TURN = "<end_of_turn>"
# A scratch folder untouched this long belongs to a conversion that was killed (a live one takes minutes).
_STALE_SCRATCH_S = 24 * 3600


def default_cache_root() -> Path:
    """Where converted GGUF models live: $PAGODA_CACHE_DIR, else ~/.cache/pagoda/models."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagoda" / "models"


def cache_folder(gguf_path: Path, cache_root: Path) -> Path:
    """The cache folder of one GGUF file: `<stem>-<key>`, the key hashing its absolute path, size and mtime.

    Hashing metadata instead of the content keeps a cache hit free of reading the file; replacing the file
    changes its mtime and so leads to a fresh conversion.
    """
    stat = gguf_path.stat()
    identity = f"{_CACHE_FORMAT}\0{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:12]
    return cache_root / f"{gguf_path.stem}-{key}"


class UntrustedCacheError(ValueError):
    """The GGUF cache root or a cached folder is not private to this user (the message says what to fix)."""


def trusted_root(root: Path) -> Path:
    """`root` created 0700 if missing; UntrustedCacheError unless it is this user's and writable by no one else."""
    try:
        make_dirs_private(root)
        check_private(root, kind="dir")
    except UnsafeCacheError as exc:
        raise UntrustedCacheError(
            f"the GGUF cache {root} is not private ({exc}): another user could plant a model there; "
            f"run `chmod 700 {root}` if it is yours, or point ${CACHE_DIR_ENV} at a folder of your own"
        ) from None
    return root


def cached_conversion(gguf_path: Path, cache_root: Path) -> Path | None:
    """The converted folder of `gguf_path` if the cache holds a trusted one, None when it holds none;
    UntrustedCacheError when the root, the folder or a file in it is not this user's alone."""
    target = cache_folder(gguf_path, trusted_root(cache_root))
    if not (target.exists() or target.is_symlink()):
        return None
    try:
        check_private(target, kind="dir")
        for path in target.iterdir():
            check_private(path, kind="file")
    except UnsafeCacheError as exc:
        raise UntrustedCacheError(
            f"the cached conversion {target} is not private ({exc}), so it is not loaded: another user may "
            f"have planted it; delete the folder {target} to convert {gguf_path.name} again"
        ) from None
    return target if is_converted(target) else None


def is_converted(folder: Path) -> bool:
    """Whether a conversion is complete there (a folder only gets its final name once fully written)."""
    return (folder / "config.json").is_file() and (folder / SAFETENSORS_SINGLE).is_file()


def convert_gguf(gguf_path: Path, cache_root: Path | None = None) -> Path:
    """The safetensors model folder for `gguf_path`, converting it on the first call.

    The conversion writes into a temporary folder next to the cache folder and renames it into place, so an
    interrupted conversion is never taken for a complete one. GGUFFileError for a malformed file,
    UntrustedCacheError for a cache that is not this user's alone (see the module).
    """
    root = default_cache_root() if cache_root is None else cache_root
    hit = cached_conversion(gguf_path, root)  # the root is private from here on
    if hit is not None:
        return hit
    target = cache_folder(gguf_path, root)
    check_gguf_file(gguf_path)  # a crafted header fails here, before transformers sizes anything by it
    _remove_stale_scratch(target)
    logger.info(
        "converting %s to %s once (dequantizing takes a while; later loads read the cache)", gguf_path, target
    )
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=root))
    try:
        _convert_into(gguf_path, scratch)
        _make_private(scratch)
        try:
            scratch.rename(target)
        except OSError:
            if not is_converted(target):  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - started)
    return target


def _remove_stale_scratch(target: Path) -> None:
    """Delete scratch folders that killed conversions of `target` left behind (`finally` never ran for them)."""
    now = time.time()
    for scratch in target.parent.glob(f".{target.name}.*.partial"):
        if now - scratch.stat().st_mtime > _STALE_SCRATCH_S:
            logger.info("removing %s, left by an interrupted conversion", scratch)
            shutil.rmtree(scratch, ignore_errors=True)


def _make_private(folder: Path) -> None:
    """Keep the converted model this user's only: folder 0700, files 0600 (whatever the umask gave the files).

    Weights a user converted may be licensed to them alone, and a folder others may write is one they could
    swap weights in."""
    folder.chmod(0o700)
    for path in folder.iterdir():
        path.chmod(0o600)


def _convert_into(gguf_path: Path, folder: Path) -> None:
    """Dequantize `gguf_path` with transformers; save config, generation config, float32 safetensors, tokenizer."""
    # Imported for a conversion only: transformers' modeling module takes ~0.7 s to import, a cached start none.
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    hf_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    config = hf_model.config
    # The weights are saved dequantized: the GGUF quantization entry would make transformers re-quantize.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(hf_model).__name__]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    dense = {
        name: tensor.contiguous()
        for name, tensor in hf_model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    state, metadata = quantized_state(gguf_path, hf_model, dense)
    save_file(
        state,
        str(folder / SAFETENSORS_SINGLE),
        metadata={"format": "pt", "source": gguf_path.name, **metadata},
    )
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _list_added_tokens(tokenizer, folder)
    generation = hf_model.generation_config
    generation.eos_token_id = _eos_token_ids(config, tokenizer, generation.eos_token_id)
    generation.save_pretrained(folder)


def _list_added_tokens(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Record the added tokens in tokenizer_config.json, as hub checkouts do.

    Without that list AutoTokenizer re-reads them from the whole tokenizer.json (33 MB and 6,384 added tokens
    for Gemma 3), which doubles the tokenizer's load time.
    """
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {
        str(index): {
            "content": token.content,
            "single_word": token.single_word,
            "lstrip": token.lstrip,
            "rstrip": token.rstrip,
            "normalized": token.normalized,
            "special": token.special,
        }
        for index, token in tokenizer.added_tokens_decoder.items()
    }
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def _eos_token_ids(
    config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, eos: int | list[int] | None
) -> list[int]:
    """The generation stop ids: the file's eos, plus <end_of_turn> for Gemma models (see _GEMMA_END_OF_TURN)."""
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    end_of_turn = tokenizer.get_vocab().get(_GEMMA_END_OF_TURN)
    if str(config.model_type).startswith("gemma") and end_of_turn is not None and end_of_turn not in ids:
        ids.append(end_of_turn)
    return ids


def check_gguf_model(model: str | None, cache_root: Path | None = None) -> None:
    """What `pagoda serve` checks before starting (a ValueError is exit 2): the cache root is private, and a
    .gguf model's cached folder is trusted or, on a cache miss, its header is well-formed (see the module)."""
    from pagoda.server.packaged import packaged_model

    root = default_cache_root() if cache_root is None else cache_root
    if (
        model is None or packaged_model(model) is not None
    ):  # checksummed files: only the cache's trust matters
        trusted_root(root)
        return
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf" and cached_conversion(path, root) is None:
        check_gguf_file(path)
