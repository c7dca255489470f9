"""CUDA C sources of the CuPy backend and the compile options that specialise them (importable without cupy).

The kernels are compiled at run time by `cupy.RawModule` (NVRTC) and, in the tests, by `nvcc -ptx`; both take
their source and options from here so that the test compiles exactly what the runtime compiles.
"""

from __future__ import annotations

import importlib.resources
import re

import torch

# The `PAGODA_DTYPE` value of each supported dtype (see pagoda_common.cuh).
DTYPE_IDS: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_HEAD_DIM = 256

# Source files (compiled per dtype, and the attention file per dtype and head_dim) and their kernels.
CACHE_OPS_FILE = "cache_ops.cu"
ATTENTION_FILE = "paged_attention.cu"
RESHAPE_AND_CACHE = "pagoda_reshape_and_cache"
COPY_BLOCKS = "pagoda_copy_blocks"
PAGED_ATTENTION = "pagoda_paged_attention"
PAGED_ATTENTION_REDUCE = "pagoda_paged_attention_reduce"
KERNELS: dict[str, tuple[str, ...]] = {
    CACHE_OPS_FILE: (RESHAPE_AND_CACHE, COPY_BLOCKS),
    ATTENTION_FILE: (PAGED_ATTENTION, PAGED_ATTENTION_REDUCE),
}

_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_.]+)"[ \t]*$', re.MULTILINE)


def read_source(name: str) -> str:
    """The text of kernel file `name` with its local `#include "..."` lines replaced by the included files.

    Inlining (instead of an -I option) keeps the source self-contained for NVRTC, which has no include path
    into an installed wheel, and makes cupy's on-disk kernel cache, keyed by source text, see header edits.
    """
    text = importlib.resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
    return _INCLUDE.sub(lambda match: read_source(match.group(1)), text)


def compile_options(dtype: torch.dtype, head_dim: int | None = None) -> tuple[str, ...]:
    """The -D options that specialise a kernel file to `dtype` (and `head_dim` for the attention kernels)."""
    if dtype not in DTYPE_IDS:
        raise TypeError(f"the cupy kernels support {sorted(map(str, DTYPE_IDS))}, got {dtype}")
    # No -std: the sources are plain C++11, and cupy's NVRTC defaults to C++17 anyway.
    options = [f"-DPAGODA_DTYPE={DTYPE_IDS[dtype]}"]
    if head_dim is not None:
        if not 0 < head_dim <= MAX_HEAD_DIM:
            raise ValueError(
                f"the cupy attention kernels support head_dim up to {MAX_HEAD_DIM}, got {head_dim}"
            )
        options.append(f"-DPAGODA_HEAD_DIM={head_dim}")
    return tuple(options)
