"""The LM head fused with the draw on the CPU: csrc/cpu_fused_head.c, compiled at first use by `cbuild`.

`fused_head(x, weight, out_dtype, inv_temperature, keys)` returns what `torch_sampling.run` returns on the logits
`qmatmul(x, weight)` (in `out_dtype`) for rows without min_p, top_k and top_p (greedy rows and plain temperature),
bit for bit, without writing the `[rows, vocab]` logits: the C file computes them a chunk of vocabulary rows at a
time with the GEMV's own column code and reduces each chunk at once (argmax, or the Gumbel-max race with the
sampler's per-(key, index) uniforms). `eligible` says which rows it takes; the others go the unfused way.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pagoda.pagedkernel import cbuild, csrc
from pagoda.pagedkernel.backend import BackendUnavailableError
from pagoda.pagedkernel.quant.formats import BLOCK_SIZES, GGMLType, QuantizedTensor
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE_FILE = "cpu_fused_head.c"
ENTRY = "pagoda_fused_head"
OWNER = "the fused LM head"
# the quantized GEMV's flags: no FMA contraction, so every logit rounds as the GEMV's does
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off")
# Rows one call takes (one pass of the GEMV's columns, cpu_quant.c's MAX_ROWS).
MAX_ROWS = 16
# The formats cpu_quant.c's GEMV columns multiply.
SUPPORTED_QTYPES = frozenset(
    {
        GGMLType.Q4_0,
        GGMLType.Q4_1,
        GGMLType.Q5_0,
        GGMLType.Q5_1,
        GGMLType.Q8_0,
        GGMLType.Q4_K,
        GGMLType.Q5_K,
        GGMLType.Q6_K,
    }
)
# Activation (and logits) dtypes the C file reads and writes as the GEMV does.
DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class HeadKernels:
    """The library's entry point: (type, w, n, k, x, x_stride, x_bf16, rows, y_bf16, inv_t, keys, tokens, status,
    num_threads) -> int."""

    run: Any


def build(flags: tuple[str, ...] = CFLAGS) -> Path:
    """The library built with `flags` (another -march tests another GEMV path), compiled unless cached.

    Raises BackendUnavailableError (CompileError with the compiler's output) when there is no compiler or it fails.
    """
    march = next((f.removeprefix("-march=") for f in flags if f.startswith("-march=")), "default")
    return cbuild.build(
        SOURCE_FILE,
        csrc.read_source(SOURCE_FILE),
        flags,
        variant=march,
        owner=OWNER,
        instead="sample the LM head's logits unfused",
        alternatives=(("-fopenmp",), ()),
        libraries=("-lm",),
    )


def load(library: Path) -> HeadKernels:
    """The entry point of a library that `build` made, with its C signature declared."""
    fn = ctypes.CDLL(str(library))[ENTRY]
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    argtypes: list[Any] = [i64, ptr, i64, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64]
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return HeadKernels(fn)


@functools.cache
def kernels() -> HeadKernels:
    """This CPU's library, built or found in the cache and loaded once per process (a damaged one is compiled
    again: `cbuild.load_or_rebuild`)."""
    return cbuild.load_or_rebuild(build, load, owner=OWNER)


@functools.cache
def available() -> bool:
    """Whether the library builds and loads here (checked once; a warning says why not)."""
    try:
        kernels()
    except (BackendUnavailableError, OSError) as exc:
        logger.warning("the LM head's logits are sampled unfused: %s", exc)
        return False
    return True


def supports_weight(weight: QuantizedTensor) -> bool:
    """Whether `weight` is a CPU LM head the C GEMV columns multiply (format, 2-D, K a multiple of blocks)."""
    return (
        weight.qtype in SUPPORTED_QTYPES
        and len(weight.shape) == 2
        and weight.data.device.type == "cpu"
        and weight.data.is_contiguous()
        and weight.shape[1] % BLOCK_SIZES[weight.qtype][0] == 0
    )


def eligible(
    top_k: Tensor,  # int64 [rows]; 0: disabled
    top_p: Tensor,  # float32 [rows]; 1: disabled
    min_p: Tensor,  # float32 [rows]; 0: disabled
    vocab: int,
) -> bool:
    """Whether every row is one the fused op draws: no truncation (top_k of 0 or >= vocab, top_p 1, min_p 0)."""
    return bool((((top_k == 0) | (top_k >= vocab)) & (top_p >= 1.0) & (min_p == 0.0)).all())


def fused_head(
    x: Tensor,  # float32 or bfloat16 [rows, K], rows contiguous
    weight: QuantizedTensor,  # [vocab, K]
    out_dtype: torch.dtype,  # the dtype the unfused GEMV writes the logits in (x's for qmatmul)
    inv_temperature: Tensor,  # float32 [rows]; 0: greedy
    keys: Tensor,  # int64 [rows]
    lib: HeadKernels | None = None,  # default: this CPU's library
) -> tuple[Tensor, Tensor]:  # int64 [rows], int32 [rows]
    """One token and one status per row: torch_sampling.run on `qmatmul(x, weight)` in `out_dtype`, bit for bit,
    for rows without min_p, top_k and top_p (`eligible`)."""
    rows = x.shape[0]
    if x.dtype not in DTYPES or out_dtype not in DTYPES or x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"fused_head reads float32 or bfloat16 rows, got {x.dtype} {tuple(x.shape)}")
    if not supports_weight(weight) or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fused_head cannot multiply a {weight.qtype.name} weight {weight.shape} by {tuple(x.shape)}"
        )
    if rows > MAX_ROWS:
        raise ValueError(f"fused_head takes at most {MAX_ROWS} rows, got {rows}")
    inv_t = inv_temperature.to(torch.float32).contiguous()
    row_keys = keys.to(torch.int64).contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    status = torch.empty(rows, dtype=torch.int32)
    n, k = weight.shape
    code = (lib or kernels()).run(
        int(weight.qtype),
        weight.data.data_ptr(),
        n,
        k,
        x.data_ptr(),
        x.stride(0),
        int(x.dtype == torch.bfloat16),
        rows,
        int(out_dtype == torch.bfloat16),
        inv_t.data_ptr(),
        row_keys.data_ptr(),
        tokens.data_ptr(),
        status.data_ptr(),
        torch.get_num_threads(),
    )
    if code == 2:
        raise MemoryError("the fused LM head could not allocate its work space")
    if code != 0:
        raise ValueError(f"the fused LM head refused its arguments (status {code})")
    return tokens, status
