"""C and CUDA C sources of the cpu and CuPy backends, read as text to compile at run time (importable anywhere).

Who compiles them owns the options: `cpu_backend` and `sampling` (through `cbuild`) the .c files, `cupy_kernels`
the .cu files. Code the files share lives in one header each: `cpu_dtype.h` (the C kernels' storage dtype and its
loads) and `pagoda_common.cuh` (the CUDA kernels'), inlined by `read_source`.
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from pagoda.pagedkernel import cbuild

# The `PAGODA_DTYPE` value of each supported dtype, in every source (see cpu_attention.c, pagoda_common.cuh).
DTYPE_IDS: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_.]+)"[ \t]*$', re.MULTILINE)


def read_source(name: str, directory: Path | None = None) -> str:
    """The text of kernel file `name` with its local `#include "..."` lines replaced by the included files.

    Inlining (instead of an -I option) keeps the source self-contained for NVRTC and the C compiler, which have
    no include path into an installed wheel, and makes the kernel caches (cupy's and `cbuild`'s), keyed by
    source text, see header edits. `directory` reads the files from there instead of this package (an edited
    copy of the sources).
    """
    folder = importlib.resources.files(__name__) if directory is None else directory
    text = folder.joinpath(name).read_text(encoding="utf-8")
    return _INCLUDE.sub(lambda match: read_source(match.group(1), directory), text)


def build_for_dtype(
    name: str,
    dtype: torch.dtype,
    flags: Sequence[str],
    *,
    owner: str,
    instead: str,
    libraries: Sequence[str] = (),
) -> Path:
    """Kernel file `name` compiled for the storage dtype `dtype` (-DPAGODA_DTYPE), with OpenMP where the compiler
    has it, unless cached: `cbuild.build` with the options every per-dtype C kernel shares."""
    return cbuild.build(
        name,
        read_source(name),
        (*flags, f"-DPAGODA_DTYPE={DTYPE_IDS[dtype]}"),
        variant=str(dtype).removeprefix("torch."),
        owner=owner,
        instead=instead,
        alternatives=(("-fopenmp",), ()),
        libraries=libraries,
    )
