"""C and CUDA C sources of the cpu and CuPy backends, read as text to compile at run time (importable anywhere).

Who compiles them owns the options: `cpu_backend` (through `cbuild`) the .c file, `cupy_kernels` the .cu files.
"""

from __future__ import annotations

import importlib.resources
import re

import torch

# The `PAGODA_DTYPE` value of each supported dtype, in every source (see cpu_attention.c, pagoda_common.cuh).
DTYPE_IDS: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_.]+)"[ \t]*$', re.MULTILINE)


def read_source(name: str) -> str:
    """The text of kernel file `name` with its local `#include "..."` lines replaced by the included files.

    Inlining (instead of an -I option) keeps the source self-contained for NVRTC, which has no include path
    into an installed wheel, and makes the kernel caches (cupy's and `cbuild`'s), keyed by source text, see
    header edits.
    """
    text = importlib.resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
    return _INCLUDE.sub(lambda match: read_source(match.group(1)), text)
