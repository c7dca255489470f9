"""The LM head fused with the draw on the CPU: csrc/cpu_fused_head.c, compiled at first use by `cbuild`.

`fused_head(x, weight, inv_temperature, keys, top_k, top_p)` returns what `torch_sampling.run` returns on the
logits `qmatmul(x, weight)` for rows without min_p, bit for bit, without writing the `[rows, vocab]` logits: the C
file computes them a chunk of vocabulary rows at a time with the GEMV's own column code and reduces each chunk at
once (argmax; the Gumbel-max race with the sampler's per-(key, index) uniforms; for top_k / top_p, candidates and
the dropped mass, from which the exact kept set follows where they prove it: a row they do not, a flat one, is
sampled from its logits, with the same token; the op writes a top_k / top_p row's logits as it computes them into a
buffer the caller passes, since computing them again would cost the whole GEMV). `eligible` says which rows it
takes; the others go the unfused way.
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
from pagoda.pagedkernel.quant import cpu_quant
from pagoda.pagedkernel.quant.formats import BLOCK_SIZES, REPACKED_TYPES, QuantizedTensor
from pagoda.pagedkernel.quant.ops import qmatmul
from pagoda.pagedkernel.sampling import cpu_sampling
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE_FILE = "cpu_fused_head.c"
ENTRY = "pagoda_fused_head"
OWNER = "the fused LM head"
# the quantized GEMV's flags: no FMA contraction, so every logit rounds as the GEMV's does
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off")
# Rows one call takes: the rows qmatmul sends to the GEMV, whose column code the C file calls (its HEAD_MAX_ROWS is
# cpu_quant.c's MAX_ROWS, the same number: tests/pagedkernel/test_fused_head_op.py holds them together).
MAX_ROWS = cpu_quant.GEMV_MAX_ROWS
# The formats cpu_quant.c's GEMV columns multiply, and Q8_0 repacked for them (quant/repack.py).
SUPPORTED_QTYPES = cpu_quant.GEMV_QTYPES | REPACKED_TYPES
# Activation (and logits) dtypes the C file reads and writes as the GEMV does.
DTYPES = (torch.float32, torch.bfloat16)
# The largest top_k drawn fused (the C file's HEAD_MAX_TOP_K; its candidates hold top_k + 64 per row and thread).
MAX_TOP_K = 4096
# The C op's status for a top_k / top_p row its candidates could not decide (HEAD_FALLBACK).
FALLBACK = 3


@dataclass(frozen=True, slots=True)
class HeadKernels:
    """The library's entry point: (type, w, n, k, x, x_stride, x_bf16, rows, y_bf16, inv_t, top_k, top_p, keys,
    tokens, status, logits, num_threads) -> int."""

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
    # (type, w, n, k, x, x_stride, x_bf16, rows, y_bf16, then seven pointers ending in logits, num_threads)
    argtypes: list[Any] = [i64, ptr, i64, i64, ptr, i64, i64, i64, i64, *[ptr] * 7, i64]
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
    """Whether every row is one the fused op draws: no min_p, and top_k disabled, at least the vocabulary or at most
    MAX_TOP_K (top_p any)."""
    # A step's few rows are read faster as Python numbers than by a handful of tensor ops (each of which costs
    # several microseconds more after the weights' stream has left the caches cold).
    return not any(min_p.tolist()) and _draws(top_k, top_p, vocab)


def truncates(top_k: Tensor, top_p: Tensor, vocab: int) -> bool:  # int64 [rows], float32 [rows]
    """Whether some row keeps fewer tokens than the vocabulary: top_k below it, or top_p below 1."""
    return any(p < 1.0 for p in top_p.tolist()) or any(0 < k < vocab for k in top_k.tolist())


def _draws(top_k: Tensor, top_p: Tensor, vocab: int) -> bool:  # int64 [rows], float32 [rows]
    """Whether the op draws these truncations: top_k at most MAX_TOP_K or the vocabulary, top_p positive."""
    return all(p > 0.0 for p in top_p.tolist()) and all(k <= MAX_TOP_K or k >= vocab for k in top_k.tolist())


def draw(
    x: Tensor,  # float32 or bfloat16 [rows, K], rows contiguous
    weight: QuantizedTensor,  # [vocab, K]
    inv_temperature: Tensor,  # float32 [rows]; 0: greedy
    keys: Tensor,  # int64 [rows]
    top_k: Tensor | None = None,  # int64 [rows]; 0: disabled
    top_p: Tensor | None = None,  # float32 [rows]; 1: disabled
    lib: HeadKernels | None = None,  # default: this CPU's library
    # x's dtype [>= rows, vocab], contiguous: where the top_k / top_p rows' logits go
    logits: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # int64 [rows], int32 [rows]: status FALLBACK where the candidates proved nothing
    """The C op alone: one token and one status per row, FALLBACK for a top_k / top_p row it could not decide.
    With `logits`, the truncated rows' logits are written there as the op computes them (the other rows' are left
    as they were), for `sample_undecided` to sample from instead of computing them again."""
    rows = x.shape[0]
    if x.dtype not in DTYPES or x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"fused_head reads float32 or bfloat16 rows, got {x.dtype} {tuple(x.shape)}")
    if not supports_weight(weight) or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fused_head cannot multiply a {weight.qtype.name} weight {weight.shape} by {tuple(x.shape)}"
        )
    if rows > MAX_ROWS:
        raise ValueError(f"fused_head takes at most {MAX_ROWS} rows, got {rows}")
    n, k = weight.shape
    if logits is not None and (
        logits.dtype != x.dtype or logits.dim() != 2 or logits.shape[0] < rows or logits.shape[1] != n
    ):
        raise ValueError(
            f"fused_head writes {x.dtype} logits [{rows}, {n}], not into {logits.dtype} {logits.shape}"
        )
    if logits is not None and not logits.is_contiguous():
        raise ValueError("fused_head writes logits into a contiguous tensor")
    ks = torch.zeros(rows, dtype=torch.int64) if top_k is None else top_k.to(torch.int64).contiguous()
    ps = torch.ones(rows, dtype=torch.float32) if top_p is None else top_p.to(torch.float32).contiguous()
    if not _draws(ks, ps, n):
        raise ValueError(f"fused_head takes top_k up to {MAX_TOP_K} and no min_p")
    inv_t = inv_temperature.to(torch.float32).contiguous()
    row_keys = keys.to(torch.int64).contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    status = torch.empty(rows, dtype=torch.int32)
    code = (lib or kernels()).run(
        int(weight.qtype),
        weight.data.data_ptr(),
        n,
        k,
        x.data_ptr(),
        x.stride(0),
        int(x.dtype == torch.bfloat16),
        rows,
        int(x.dtype == torch.bfloat16),  # the GEMV writes x's dtype (qmatmul)
        inv_t.data_ptr(),
        ks.data_ptr(),
        ps.data_ptr(),
        row_keys.data_ptr(),
        tokens.data_ptr(),
        status.data_ptr(),
        None if logits is None else logits.data_ptr(),
        torch.get_num_threads(),
    )
    if code == 2:
        raise MemoryError("the fused LM head could not allocate its work space")
    if code != 0:
        raise ValueError(f"the fused LM head refused its arguments (status {code})")
    return tokens, status


def fused_head(
    x: Tensor,  # float32 or bfloat16 [rows, K], rows contiguous
    weight: QuantizedTensor,  # [vocab, K]
    inv_temperature: Tensor,  # float32 [rows]; 0: greedy
    keys: Tensor,  # int64 [rows]
    top_k: Tensor | None = None,  # int64 [rows]; 0: disabled
    top_p: Tensor | None = None,  # float32 [rows]; 1: disabled
    lib: HeadKernels | None = None,  # default: this CPU's library
) -> tuple[Tensor, Tensor]:  # int64 [rows], int32 [rows]
    """One token and one status per row: torch_sampling.run on the logits `qmatmul(x, weight)` (x's dtype), bit for
    bit, for rows without min_p (`eligible`); the rows the C op leaves undecided are sampled from their logits."""
    logits = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    tokens, status = draw(x, weight, inv_temperature, keys, top_k, top_p, lib, logits)
    sample_undecided(x, weight, inv_temperature, keys, top_k, top_p, tokens, status, logits)
    return tokens, status


def sample_undecided(
    x: Tensor,  # [rows, K]: draw's
    weight: QuantizedTensor,  # [vocab, K]
    inv_temperature: Tensor,  # float32 [rows]
    keys: Tensor,  # int64 [rows]
    top_k: Tensor | None,  # int64 [rows]
    top_p: Tensor | None,  # float32 [rows]
    tokens: Tensor,  # int64 [rows]: draw's, completed in place
    status: Tensor,  # int32 [rows]: draw's, completed in place
    logits: Tensor | None = None,  # [>= rows, vocab]: draw's `logits`, where it wrote them
) -> int:
    """Sample draw's FALLBACK rows from their logits (draw's `logits`, else `qmatmul` again; then the `cpu` sampling
    op: the tokens the fused op would have drawn); how many there were."""
    if FALLBACK not in status.tolist():  # the common case, read without a tensor op
        return 0
    undecided = (status == FALLBACK).nonzero().squeeze(1)
    rows = int(undecided.numel())
    if rows:
        if logits is None:
            logits = qmatmul(x.index_select(0, undecided), weight, backend="cpu")
        elif rows == tokens.shape[0]:  # every row: a view, not a copy of megabytes
            logits = logits[:rows]
        else:
            logits = logits.index_select(0, undecided)
        ks = torch.zeros(rows, dtype=torch.int64) if top_k is None else top_k[undecided]
        ps = torch.ones(rows) if top_p is None else top_p[undecided]
        got, got_status, _ = cpu_sampling.run(
            logits, inv_temperature[undecided], ks, ps, torch.zeros(rows), keys[undecided], with_mask=False
        )
        tokens[undecided] = got
        status[undecided] = got_status
    return rows
