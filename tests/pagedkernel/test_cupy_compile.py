"""The CuPy backend's CUDA sources compile, without a GPU, for every specialisation the runtime uses.

The sources and -D options come from `pagoda.pagedkernel.csrc`, the same functions `cupy_backend` hands to
`cupy.RawModule`, so this compiles exactly what the runtime compiles (with nvcc instead of NVRTC). `-cubin` also
runs ptxas, which checks the inline PTX that `-ptx` alone would pass through unchecked.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pagoda.pagedkernel import csrc

NVCC = shutil.which("nvcc")
ARCH = "sm_90"
# Head dims: below the 128-thread block (grouped value pass), not a multiple of 32 (partial lanes), equal to
# it, and the largest (two dims per thread).
HEAD_DIMS = (64, 80, 128, 256)
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

SPECIALISATIONS = [
    pytest.param(csrc.CACHE_OPS_FILE, dtype, None, id=f"cache_ops-{DTYPE_NAMES[dtype]}")
    for dtype in csrc.DTYPE_IDS
] + [
    pytest.param(csrc.ATTENTION_FILE, dtype, head_dim, id=f"attention-{DTYPE_NAMES[dtype]}-d{head_dim}")
    for dtype in csrc.DTYPE_IDS
    for head_dim in HEAD_DIMS
]


def test_every_kernel_file_is_covered() -> None:
    """Each .cu file shipped in csrc/ is listed in KERNELS, so the compile test below reaches it."""
    shipped = {path.name for path in Path(csrc.__file__).parent.glob("*.cu")}
    assert shipped == set(csrc.KERNELS)


def test_sources_are_self_contained() -> None:
    """Local includes are inlined and no CUDA header is needed (NVRTC from the pip wheels has no toolkit)."""
    for file in csrc.KERNELS:
        source = csrc.read_source(file)
        assert re.search(r"^\s*#\s*include", source, re.MULTILINE) is None, file


def test_compile_options_reject_unsupported() -> None:
    """Unsupported dtypes and head dims fail before reaching the compiler."""
    assert csrc.compile_options(torch.bfloat16, 128) == (
        "-std=c++17",
        "-DPAGODA_DTYPE=2",
        "-DPAGODA_HEAD_DIM=128",
    )
    with pytest.raises(TypeError, match="float64"):
        csrc.compile_options(torch.float64)
    with pytest.raises(ValueError, match="head_dim"):
        csrc.compile_options(torch.float16, csrc.MAX_HEAD_DIM + 1)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize(("file", "dtype", "head_dim"), SPECIALISATIONS)
def test_kernels_compile(tmp_path: Path, file: str, dtype: torch.dtype, head_dim: int | None) -> None:
    """nvcc compiles the file for sm_90 with the runtime's options, warning-free, and emits each kernel."""
    assert NVCC is not None
    source = tmp_path / file
    source.write_text(csrc.read_source(file))
    cubin = tmp_path / "kernels.cubin"
    command = [
        NVCC,
        "-cubin",
        f"-arch={ARCH}",
        "--Werror",
        "all-warnings",
        *csrc.compile_options(dtype, head_dim),
        str(source),
        "-o",
        str(cubin),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}{result.stderr}"
    binary = cubin.read_bytes()
    for kernel in csrc.KERNELS[file]:
        # extern "C" keeps the names unmangled, which is what get_function looks up.
        assert kernel.encode() + b"\0" in binary, kernel


def test_import_without_cupy_names_the_wheel() -> None:
    """Importing the backend without cupy raises an ImportError that says to install cupy-cuda12x."""
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed")
    sys.modules.pop("pagoda.pagedkernel.cupy_backend", None)
    with pytest.raises(ImportError, match="cupy-cuda12x"):
        importlib.import_module("pagoda.pagedkernel.cupy_backend")
