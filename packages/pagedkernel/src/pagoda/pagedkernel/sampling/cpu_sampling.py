"""The `cpu` backend of the sampling op: csrc/cpu_sampling.c, compiled at first use and loaded with ctypes.

The C kernel computes bitwise the tokens of the torch specification (torch_sampling.py) in a few passes per row
(see the C file): temperature, min_p, top_k and top_p thresholds found by selection over the few elements that
can reach them, then a Gumbel-max draw that hashes only the elements that can still win. Rows and vocabulary
slices run on torch's OpenMP pool (the library links the libgomp.so.1 torch has loaded, as the attention kernel
does); a compiler without OpenMP builds a single-threaded library with the same results. A library that will not
load, even compiled afresh (`cbuild.load_or_rebuild`), leaves its dtype to the torch specification, with a warning.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pagoda.pagedkernel import cbuild, csrc
from pagoda.pagedkernel.backend import BackendUnavailableError
from pagoda.pagedkernel.sampling import torch_sampling
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE_FILE = "cpu_sampling.c"
ENTRY = "pagoda_sample"
# -ffp-contract=off: no fused multiply-add, so every float operation rounds as the torch specification's does.
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off")
OPENMP_FLAGS = ("-fopenmp",)
DTYPE_IDS = csrc.DTYPE_IDS


def build(dtype: torch.dtype, flags: tuple[str, ...] = CFLAGS) -> Path:
    """The sampling library for logits of `dtype`, compiled unless cached (see `cbuild.build`).

    Raises BackendUnavailableError (with the compiler's output) when there is no compiler or it fails.
    """
    return cbuild.build(
        SOURCE_FILE,
        csrc.read_source(SOURCE_FILE),
        (*flags, f"-DPAGODA_DTYPE={DTYPE_IDS[dtype]}"),
        variant=str(dtype).removeprefix("torch."),
        owner="the 'cpu' sampling backend",
        instead="use the 'torch' sampling backend",
        alternatives=(OPENMP_FLAGS, ()),
        libraries=("-lm",),
    )


def load(library: Path) -> Callable[..., int]:
    """The library's entry point with its C signature declared."""
    fn = ctypes.CDLL(str(library))[ENTRY]
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    argtypes: list[Any] = [ptr, i64, i64, i64] + [ptr] * 8 + [i64]
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _entry(dtype: torch.dtype) -> Callable[..., int] | None:
    """The entry point for `dtype`, built (or found in the cache) and loaded once per process (a damaged one is
    compiled again: `cbuild.load_or_rebuild`); None, with a warning, where it cannot be (torch samples instead)."""
    try:
        return cbuild.load_or_rebuild(lambda: build(dtype), load, owner="the 'cpu' sampling backend")
    except (BackendUnavailableError, OSError) as exc:
        logger.warning("%s logits are sampled by torch: %s", dtype, exc)
        return None


def available() -> bool:
    """Whether the float32 library compiles and loads here."""
    return _entry(torch.float32) is not None


def run(
    logits: Tensor,  # [rows, vocab]
    inv_temperature: Tensor,  # float32 [rows]
    top_k: Tensor,  # int64 [rows]
    top_p: Tensor,  # float32 [rows]
    min_p: Tensor,  # float32 [rows]
    keys: Tensor,  # int64 [rows]
    *,
    with_mask: bool,
    entry: Callable[..., int] | None = None,  # default: this dtype's build
) -> tuple[Tensor, Tensor, Tensor | None]:  # int64 [rows], int32 [rows], bool [rows, vocab] or None
    """Call the C kernel: tokens, status and (with_mask) the kept mask."""
    if logits.device.type != "cpu" or logits.dtype not in DTYPE_IDS:
        raise ValueError(f"the 'cpu' sampler takes CPU logits of {sorted(map(str, DTYPE_IDS))}")
    if logits.stride(1) != 1 or logits.stride(0) < logits.shape[1]:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    args = [
        inv_temperature.to(torch.float32).contiguous(),
        top_k.to(torch.int64).contiguous(),
        top_p.to(torch.float32).contiguous(),
        min_p.to(torch.float32).contiguous(),
        keys.to(torch.int64).contiguous(),
    ]
    tokens = torch.empty(rows, dtype=torch.int64)
    status = torch.empty(rows, dtype=torch.int32)
    mask = torch.empty((rows, vocab), dtype=torch.uint8) if with_mask else None
    entry = entry or _entry(logits.dtype)
    if entry is None:  # the library would not load: the specification gives the same tokens, bit for bit
        return torch_sampling.run(logits, inv_temperature, top_k, top_p, min_p, keys, with_mask=with_mask)
    code = entry(
        logits.data_ptr(),
        rows,
        vocab,
        logits.stride(0) if rows else vocab,
        *(a.data_ptr() for a in args),
        tokens.data_ptr(),
        status.data_ptr(),
        mask.data_ptr() if mask is not None else None,
        torch.get_num_threads(),
    )
    if code == 2:
        raise MemoryError("the 'cpu' sampler could not allocate its work space")
    if code != 0:
        raise ValueError(f"the 'cpu' sampler refused logits of shape {tuple(logits.shape)}")
    return tokens, status, None if mask is None else mask.bool()
