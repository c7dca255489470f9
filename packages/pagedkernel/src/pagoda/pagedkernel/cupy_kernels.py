"""The CuPy backend's CUDA C kernels (`csrc/*.cu`): their files, entry points and NVRTC options (no cupy needed).

`cupy_backend` compiles them at run time with `cupy.RawModule` (NVRTC) and the tests with `nvcc`, both from
`csrc.read_source` and `compile_options` here, so that the tests compile exactly what the runtime compiles.
"""

from __future__ import annotations

import torch
from pagoda.pagedkernel.csrc import DTYPE_IDS

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


def compile_options(
    dtype: torch.dtype, head_dim: int | None = None, *, int8_cache: bool = False
) -> tuple[str, ...]:
    """The -D options that specialise a kernel file to `dtype` (and `head_dim` for the attention kernels, over
    int8 caches with scales when `int8_cache`)."""
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
    if int8_cache:
        options.append("-DPAGODA_KV_INT8=1")
    return tuple(options)
