"""Grammar token bitmasks (xgrammar's packed layout) applied to logits rows in place: the structured-output step.

A bitmask row is int32 words covering the vocabulary, bit `t % 32` of word `t // 32` set when token `t` is
allowed; a masked token's logit becomes -inf. On the CPU a C kernel (csrc/cpu_token_bitmask.c) does this a word
at a time, skipping all-allowed words and storing runs of -inf for all-masked ones; elsewhere, and without a C
compiler, the torch path below (the specification) unpacks the words and fills.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from pagoda.pagedkernel import cbuild, csrc
from pagoda.pagedkernel.backend import BackendUnavailableError
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE_FILE = "cpu_token_bitmask.c"
ENTRY = "pagoda_apply_token_bitmask"
CFLAGS = ("-O3", "-march=native")


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def build(flags: tuple[str, ...] = CFLAGS) -> Path:
    """The bitmask library, compiled unless cached (BackendUnavailableError without a working compiler)."""
    return cbuild.build(
        SOURCE_FILE,
        csrc.read_source(SOURCE_FILE),
        flags,
        variant="any",
        owner="the CPU token bitmask",
        instead="the torch token bitmask is used",
    )


def load(library: Path) -> Callable[..., int]:
    """The library's entry point with its C signature declared."""
    fn = ctypes.CDLL(str(library))[ENTRY]
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    argtypes: list[Any] = [ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, ctypes.c_uint32]
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _entry() -> Callable[..., int] | None:
    """The C entry point, built (or found in the cache) and loaded once per process (a damaged one is compiled
    again: `cbuild.load_or_rebuild`); None where it cannot be."""
    try:
        return cbuild.load_or_rebuild(build, load, owner="the CPU token bitmask")
    except (BackendUnavailableError, OSError) as exc:
        logger.warning("the token bitmask falls back to torch: %s", exc)
        return None


def c_kernel_available() -> bool:
    """Whether the C kernel compiles and loads here (else CPU logits take the torch path)."""
    return _entry() is not None


def _neg_inf_bits(dtype: torch.dtype) -> int:
    """-inf's bit pattern in `dtype` (float32, float16 or bfloat16), as an unsigned integer."""
    if dtype == torch.float32:
        return int(struct.unpack("<I", struct.pack("<f", float("-inf")))[0])
    return int(torch.tensor(float("-inf"), dtype=dtype).view(torch.int16).item()) & 0xFFFF


def apply_token_bitmask_(
    logits: Tensor,  # [num_rows, width], edited in place
    bitmask: Tensor,  # int32 [>= num_rows, >= ceil(vocab_size / 32)], on the CPU
    rows: Sequence[int],  # the rows to mask (distinct); the others are left untouched
    vocab_size: int,  # tokens the bitmask covers; columns vocab_size.. of those rows become -inf
    *,
    use_c: bool = True,  # False: the torch path, whatever the device
) -> None:
    """Set each listed row's masked logits, and its columns past `vocab_size`, to -inf."""
    if not rows:
        return
    if (
        bitmask.dtype != torch.int32
        or bitmask.device.type != "cpu"
        or bitmask.shape[1] < bitmask_words(vocab_size)
    ):
        raise ValueError("the token bitmask must be a CPU int32 tensor covering the vocabulary")
    if vocab_size > logits.shape[1] or max(rows) >= min(logits.shape[0], bitmask.shape[0]) or min(rows) < 0:
        raise ValueError("a row or the vocabulary falls outside the logits or the bitmask")
    entry = _entry() if use_c and logits.device.type == "cpu" else None
    if (
        entry is not None
        and logits.dtype in csrc.DTYPE_IDS
        and logits.stride(1) == 1
        and bitmask.stride(1) == 1
    ):
        index = torch.tensor(rows, dtype=torch.int64)
        code = entry(
            logits.data_ptr(),
            logits.element_size(),
            logits.stride(0),
            logits.shape[1],
            bitmask.data_ptr(),
            bitmask.stride(0),
            index.data_ptr(),
            len(rows),
            vocab_size,
            _neg_inf_bits(logits.dtype),
        )
        if code != 0:
            raise ValueError(f"the CPU token bitmask refused logits of {logits.dtype}")
        return
    _apply_torch(logits, bitmask, rows, vocab_size)


def _apply_torch(
    logits: Tensor,  # [num_rows, width]
    bitmask: Tensor,  # int32 [>= num_rows, >= ceil(vocab_size / 32)], on the CPU
    rows: Sequence[int],
    vocab_size: int,
) -> None:
    """The specification: unpack the listed rows' words to one bool per token and fill the masked ones."""
    words = bitmask[list(rows), : bitmask_words(vocab_size)].to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]  # [len(rows), vocab]
    index = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
    masked = logits.index_select(0, index)
    masked[:, :vocab_size].masked_fill_(~allowed, float("-inf"))
    masked[:, vocab_size:] = float("-inf")
    logits.index_copy_(0, index, masked)
