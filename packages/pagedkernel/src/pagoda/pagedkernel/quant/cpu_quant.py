"""The `cpu` backend of the quantized ops: csrc/cpu_quant.c, compiled at first use by `cbuild`, loaded with ctypes.

`dequantize` is the C unpacking (bit-exact with the torch specification). `qmatmul` has four paths: few rows go
to the C kernel that streams each weight block once and multiplies int8 activations (`gemv`: VNNI, AVX2 or generic
C, whichever the build targets); from `AMX_MIN_ROWS` bfloat16 rows on, where the CPU has AMX, a C kernel
dequantizes W 32 rows at a time into a bfloat16 panel in cache and multiplies it on the tile unit (`amx`);
elsewhere, above `GEMV_MAX_ROWS` rows, a C kernel dequantizes W a panel at a time into cache and multiplies it on
the vector unit (`vector`: float32 fused multiply-adds, or AVX-512 BF16 pair dot products for bfloat16 x where the
CPU has them), except for `VECTOR_MAX_ROWS` rows or more of a weight small enough to dequantize whole, which is
dequantized and multiplied by torch's matmul (`tiled`: oneDNN's blocking wins there; not for the repacked layouts
on AVX2, `int8_at_any_rows`). None of them makes the dense weights exist whole in memory for longer than one call,
and none for the large matrices at all.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pagoda.pagedkernel import cbuild, csrc
from pagoda.pagedkernel.backend import BackendUnavailableError
from pagoda.pagedkernel.quant import repack
from pagoda.pagedkernel.quant.formats import BLOCK_SIZES, REPACKED_TYPES, GGMLType, QuantizedTensor
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE_FILE = "cpu_quant.c"
# -ffp-contract=off: no fused multiply-add, so dequantization rounds as the reference does and every path adds
# its lanes in the same operations.
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off")
OPENMP_FLAGS = ("-fopenmp",)
# above this many rows of x, dequantized tiles and torch's matmul beat the int8 dot products; also the rows one call
# of the native decode layers or the fused head takes (cpu_quant.c's MAX_ROWS, one pass of the GEMV's columns)
GEMV_MAX_ROWS = 16
# from this many bfloat16 rows of x on, the AMX matmul beats the int8 dot products (it pays a dequantization of W
# per call, which one pass of int8 products undercuts only for a few rows: measured on a Sapphire Rapids)
AMX_MIN_ROWS = 6
# from this many rows on, a weight of at most WHOLE_ELEMENTS is dequantized whole and multiplied by torch's matmul
# rather than by the vector kernel (whose micro tiles reach ~85% of oneDNN's on such sizes, with the dequantization
# on top: measured on a Sapphire Rapids in float32 and in AVX-512 BF16)
VECTOR_MAX_ROWS = 512
# float32 elements of W per dequantized tile (2 MB: stays in L2/L3 while it is multiplied)
TILE_ELEMENTS = 1 << 19
# up to this many elements (16 MB of float32: a fused gate/up of 4,096 x 640 fits) W is dequantized whole, for one
# matmul call (a 2,048-row prefill chunk of that gate/up: 31.6 ms so, 40.4 ms on the vector unit, 46.0 ms by
# oneDNN's packed dense weight; Sapphire Rapids, float32)
WHOLE_ELEMENTS = 1 << 22


class KernelPath(enum.IntEnum):
    """Which dot-product code a build of the library runs (`pagoda_quant_path` in the C file)."""

    GENERIC = 0
    AVX2 = 1
    AVX512_VNNI = 2


@dataclass(frozen=True, slots=True)
class QuantKernels:
    """The entry points of one compiled library (see the C file for their contracts)."""

    path: KernelPath
    dequantize: Any  # ctypes function: (type, src, dst, bf16, num_blocks, num_threads) -> int
    # ctypes function: (type, w, n, k, x, x_stride, x_bf16, rows, y, y_stride, y_bf16, num_threads) -> int
    matmul: Any
    # ctypes function of matmul's arguments: the vector unit's float32 many-row matmul (every build)
    matmul_fma: Any
    # ctypes function of matmul's arguments (x bfloat16 only), or None where the build has no AMX or the OS
    # refuses this process the tile state
    matmul_amx: Any | None = None
    # ctypes function of matmul's arguments (x bfloat16 only): the AVX-512 BF16 many-row matmul, or None where the
    # build has no AVX-512 BF16
    matmul_dpbf16: Any | None = None
    # ctypes function: (type, w, n, k, row0, row1, dst, bf16, num_threads) -> int, rows of a repacked layout
    dequantize_r16: Any | None = None
    # ctypes function: (type, w, n, k, ids, m, dst, bf16) -> int, the rows ids of a repacked layout
    take_r16: Any | None = None


def build(flags: tuple[str, ...] = CFLAGS) -> Path:
    """The library built with `flags` (e.g. another -march to test a path), compiled unless cached.

    Raises BackendUnavailableError (with the compiler's output) when there is no compiler or it fails.
    """
    march = next((f.removeprefix("-march=") for f in flags if f.startswith("-march=")), "default")
    return cbuild.build(
        SOURCE_FILE,
        csrc.read_source(SOURCE_FILE),
        flags,
        variant=march,
        owner="the 'cpu' quantized ops",
        instead="use backend='torch'",
        alternatives=(OPENMP_FLAGS, ()),
        libraries=("-lm",),
    )


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# both matmuls' C signature: (type, w, n, k, x, x_stride, x_bf16, rows, y, y_stride, y_bf16, num_threads)
MATMUL_ARGTYPES = (_I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64)


def load(library: Path) -> QuantKernels:
    """The entry points of a library that `build` made, with their C signatures declared."""
    lib = ctypes.CDLL(str(library))
    path = lib["pagoda_quant_path"]
    path.argtypes, path.restype = [], ctypes.c_int
    deq = lib["pagoda_quant_dequantize"]
    deq.argtypes, deq.restype = [_I64, _PTR, _PTR, _I64, _I64, _I64], ctypes.c_int
    return QuantKernels(
        KernelPath(path()),
        deq,
        _declared(lib["pagoda_quant_matmul"]),
        _declared(lib["pagoda_quant_matmul_fma"]),
        _amx_matmul(lib),
        _declared(lib["pagoda_quant_matmul_dpbf16"]) if hasattr(lib, "pagoda_quant_matmul_dpbf16") else None,
        *_dequantize_r16(lib),
    )


def _dequantize_r16(lib: ctypes.CDLL) -> tuple[Any, Any]:
    """The repacked layouts' dequantization of a run of tiles and of rows by id, declared."""
    run = lib["pagoda_quant_dequantize_r16"]
    run.argtypes, run.restype = [_I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _I64], ctypes.c_int
    take = lib["pagoda_quant_take_r16"]
    take.argtypes, take.restype = [_I64, _PTR, _I64, _I64, _PTR, _I64, _PTR, _I64], ctypes.c_int
    return run, take


def _declared(mm: Any) -> Any:
    """A C matmul with its signature declared (`MATMUL_ARGTYPES`, int status)."""
    mm.argtypes, mm.restype = list(MATMUL_ARGTYPES), ctypes.c_int
    return mm


def _amx_matmul(lib: ctypes.CDLL) -> Any | None:
    """The library's AMX matmul, declared, when it was built with AMX and the OS grants the tile state; else None."""
    try:
        grant, mm = lib["pagoda_quant_amx"], lib["pagoda_quant_matmul_amx"]
    except AttributeError:  # built for a target without AMX
        return None
    grant.argtypes, grant.restype = [], ctypes.c_int
    if not grant():
        logger.info("the OS refused the AMX tile state: many-row quantized matmuls use the vector unit")
        return None
    return _declared(mm)


@functools.cache
def kernels() -> QuantKernels:
    """This CPU's library (-march=native), built or found in the cache and loaded once per process (a damaged one is
    compiled again: `cbuild.load_or_rebuild`)."""
    return cbuild.load_or_rebuild(build, load, owner="the 'cpu' quantized ops")


@functools.cache
def available() -> bool:
    """Whether this CPU's library builds and loads (checked once per process; `auto` falls back to torch without
    it, with one logged warning that says why)."""
    try:
        kernels()
    except (BackendUnavailableError, OSError) as exc:
        logger.warning("the quantized ops fall back to torch: %s", exc)
        return False
    return True


def _check(code: int, what: str) -> None:
    """Turn the C kernel's status into an exception."""
    if code == 2:
        raise MemoryError(f"the 'cpu' {what} could not allocate its work space")
    if code != 0:
        raise ValueError(f"the 'cpu' {what} refused its arguments (status {code})")


def dequantize_rows(
    weight: QuantizedTensor,
    start: int,
    stop: int,
    out: Tensor,  # float32 or bfloat16 [stop - start, shape[-1]], contiguous
    lib: QuantKernels,
) -> None:
    """Dequantize rows start..stop of a 2-D view of `weight` into `out` (bfloat16: rounded to nearest even,
    bitwise what `.to(torch.bfloat16)` of the float32 values gives, NaNs aside: any NaN is a NaN)."""
    if out.dtype not in (torch.float32, torch.bfloat16) or not out.is_contiguous():
        raise ValueError(f"dequantize_rows writes a contiguous float32 or bfloat16 tensor, got {out.dtype}")
    aligned = start % repack.TILE_ROWS == 0 and (stop % repack.TILE_ROWS == 0 or stop == weight.rows)
    if weight.qtype in REPACKED_TYPES and aligned and lib.dequantize_r16 is not None:  # whole tiles
        data = weight.data if weight.data.is_contiguous() else weight.data.contiguous()
        args = (weight.rows, weight.shape[-1], start, stop, out.data_ptr(), int(out.dtype == torch.bfloat16))
        _check(
            lib.dequantize_r16(int(weight.qtype), data.data_ptr(), *args, torch.get_num_threads()),
            "dequantize",
        )
        return
    if weight.qtype in REPACKED_TYPES:  # the rows in their own format first (a gather, no arithmetic)
        for first in range(start, stop, repack.CHUNK_ROWS):
            last = min(stop, first + repack.CHUNK_ROWS)
            rows = repack.take_rows(weight, torch.arange(first, last))
            dequantize_rows(rows, 0, last - first, out[first - start : last - start], lib)
        return
    data = weight.data if weight.data.is_contiguous() else weight.data.contiguous()
    blocks_per_row = weight.shape[-1] // BLOCK_SIZES[weight.qtype][0]
    code = lib.dequantize(
        int(weight.qtype),
        data.data_ptr() + start * weight.row_bytes,
        out.data_ptr(),
        int(out.dtype == torch.bfloat16),
        (stop - start) * blocks_per_row,
        torch.get_num_threads(),
    )
    _check(code, "dequantize")


def dequantize_ids(weight: QuantizedTensor, ids: Tensor, lib: QuantKernels) -> Tensor:  # float32 [m, K]
    """Rows `ids` (int64 [m]) of a 2-D view of `weight`, dequantized: an embedding lookup that reads only those
    rows (a repacked layout's straight from its tiles, one C call); ValueError for an id out of range."""
    if weight.qtype not in REPACKED_TYPES or lib.take_r16 is None:
        return dequantize(repack.take_rows(weight, ids), lib)
    picked = ids.to(torch.int64).contiguous()
    out = torch.empty((int(picked.shape[0]), weight.shape[-1]), dtype=torch.float32)
    data = weight.data if weight.data.is_contiguous() else weight.data.contiguous()
    args = (weight.rows, weight.shape[-1], picked.data_ptr(), int(picked.shape[0]), out.data_ptr(), 0)
    if lib.take_r16(int(weight.qtype), data.data_ptr(), *args) != 0:
        raise ValueError(f"embedding ids must be in 0..{weight.rows - 1}")
    return out


def dequantize(weight: QuantizedTensor, lib: QuantKernels) -> Tensor:  # float32 weight.shape
    """The float32 values of `weight` (CPU), bit-exact with the torch specification."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    dequantize_rows(weight, 0, weight.rows, out.view(weight.rows, weight.shape[-1]), lib)
    return out


# The activation and output dtypes the C matmul reads and writes directly (bfloat16: no copies on either side).
GEMV_DTYPES = (torch.float32, torch.bfloat16)
# The formats the GEMV's column functions multiply (the native decode layers and the fused LM head call them).
GEMV_QTYPES = frozenset(
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


def repacked_layout(qtype: GGMLType, *, prompts: bool = False) -> GGMLType | None:
    """The layout this CPU's kernels multiply a `qtype` weight fastest in (`repack.py`), where that is not `qtype`
    itself: the `_R16` tiles of Q8_0, Q4_1, Q5_0, Q4_K and Q6_K on a build with AVX-512 VNNI (512-bit operands) or
    AVX2 (256-bit: vpmaddubsw); else None. `prompts`: the weight also multiplies prompts' tens to hundreds of rows,
    which a build with AMX runs on its bfloat16 tiles (the repacked layout has only the int8 kernel below
    `VECTOR_MAX_ROWS`): None there; and so for Q6_K on AVX2, whose prompt rows the float32 vector kernel runs
    faster (its halves' scales cost the 256-bit int8 form a third more operations a product)."""
    if qtype not in repack.LAYOUT_OF or not available():
        return None
    lib = kernels()
    if lib.path is KernelPath.AVX2:
        return None if prompts and qtype is GGMLType.Q6_K else repack.LAYOUT_OF[qtype]
    if lib.path is not KernelPath.AVX512_VNNI or (prompts and lib.matmul_amx is not None):
        return None
    return repack.LAYOUT_OF[qtype]


def int8_at_any_rows(qtype: GGMLType, lib: QuantKernels) -> bool:
    """Whether a prompt's `VECTOR_MAX_ROWS` rows or more of a `qtype` weight (small enough to dequantize whole) take
    the int8 kernel rather than the tiled path: the repacked layouts on AVX2, except Q6_K_R16. Why: on AVX2 torch's
    float32 matmul ran at 65-80% of the FMA peak, and the int8 tiles' many-row form outran it
    (`ffn_gate` size, Q5_0 2,048 x 640: 512 rows 1.47x, 2,048 rows 1.17x; Q4_1 1.25-1.37x, Q8_0 1.28-1.43x, Q4_K
    1.00-1.16x; a 32 x 128-token Gemma 3 prefill 6.64 -> 5.68 s; 2-core AMD EPYC Zen 3), while Q6_K's half sums
    left it at 0.71x at 2,048 rows. Elsewhere (VNNI, measured with AMX beside it) the tiled path keeps them."""
    return lib.path is KernelPath.AVX2 and qtype in REPACKED_TYPES and qtype is not GGMLType.Q6_K_R16


def _matmul(
    run: Any,
    x: Tensor,  # [rows, K], rows contiguous
    weight: QuantizedTensor,  # [N, K]
    out: Tensor,  # float32 or bfloat16 [rows, N], rows contiguous
    what: str,
) -> None:
    """Call one of the C matmuls (`pagoda_quant_matmul`'s arguments) on these tensors; raise on its status."""
    data = weight.data if weight.data.is_contiguous() else weight.data.contiguous()
    n, k = weight.shape
    code = run(
        int(weight.qtype),
        data.data_ptr(),
        n,
        k,
        x.data_ptr(),
        x.stride(0),
        int(x.dtype == torch.bfloat16),
        x.shape[0],
        out.data_ptr(),
        out.stride(0),
        int(out.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    _check(code, what)


def _check_rows(what: str, x: Tensor, out: Tensor) -> None:
    """Refuse x or out that a float32-or-bfloat16 C matmul (gemv, vector) cannot read or write as rows."""
    if x.dtype not in GEMV_DTYPES or out.dtype not in GEMV_DTYPES or x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"{what} reads and writes float32 or bfloat16 rows, got {x.dtype} -> {out.dtype}")


def _refuse_repacked(weight: QuantizedTensor, what: str) -> None:
    """A repacked layout is multiplied by `gemv` alone (these paths dequantize panels of row-major blocks)."""
    if weight.qtype in REPACKED_TYPES:
        raise ValueError(f"{what} does not take the repacked {weight.qtype.name} layout: gemv multiplies it")


def gemv(
    x: Tensor,  # float32 or bfloat16 [rows, K], rows contiguous
    weight: QuantizedTensor,  # [N, K]
    out: Tensor,  # float32 or bfloat16 [rows, N], rows contiguous
    lib: QuantKernels,
) -> None:
    """out = x @ W^T by the int8 dot-product kernel (one pass over W per 16 rows), computed in float32; a bfloat16
    out is the float32 result rounded to nearest even."""
    _check_rows("gemv", x, out)
    _matmul(lib.matmul, x, weight, out, "quantized matmul")


def amx(
    x: Tensor,  # bfloat16 [rows, K], rows contiguous
    weight: QuantizedTensor,  # [N, K]
    out: Tensor,  # float32 or bfloat16 [rows, N], rows contiguous
    lib: QuantKernels,
) -> None:
    """out = x @ W^T on the AMX tile unit: W dequantized to bfloat16 32 rows at a time into a panel that stays in
    cache (one pass over W for every row of x), products summed in float32; a bfloat16 out is rounded to nearest
    even. Needs `lib.matmul_amx`."""
    _refuse_repacked(weight, "amx")
    if lib.matmul_amx is None:
        raise ValueError("this build of the quantized ops has no AMX matmul")
    if x.dtype != torch.bfloat16 or out.dtype not in GEMV_DTYPES or x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(
            f"amx reads bfloat16 rows and writes float32 or bfloat16 rows, got {x.dtype} -> {out.dtype}"
        )
    _matmul(lib.matmul_amx, x, weight, out, "AMX quantized matmul")


def vector(
    x: Tensor,  # float32 or bfloat16 [rows, K], rows contiguous
    weight: QuantizedTensor,  # [N, K]
    out: Tensor,  # float32 or bfloat16 [rows, N], rows contiguous
    lib: QuantKernels,
) -> None:
    """out = x @ W^T on the vector unit: W dequantized a panel at a time into cache (one pass over W per group of
    rows that fits L2), multiplied in float32 (`matmul_fma`, x widened exactly), or for bfloat16 x in bfloat16
    pairs where the build has AVX-512 BF16 (`matmul_dpbf16`: W rounded to bfloat16, the numerics of a dense
    bfloat16 matmul); a bfloat16 out is rounded to nearest even."""
    _check_rows("vector", x, out)
    _refuse_repacked(weight, "vector")
    pairs = x.dtype == torch.bfloat16 and lib.matmul_dpbf16 is not None
    _matmul(lib.matmul_dpbf16 if pairs else lib.matmul_fma, x, weight, out, "vector quantized matmul")


def tiled(
    x: Tensor,  # float32 or bfloat16 [rows, K]
    weight: QuantizedTensor,  # [N, K]
    out: Tensor,  # [rows, N], any float dtype
    lib: QuantKernels,
) -> None:
    """out = x @ W^T, W dequantized a tile of rows at a time into one reused buffer of x's dtype and fed to torch's
    matmul (bfloat16: the numerics of a dense bfloat16 weight, on AMX / AVX512-BF16 where the CPU has them)."""
    n, k = weight.shape
    # A weight that fits the caches anyway is dequantized in one piece and multiplied in one call (several
    # calls would only add their overhead); a larger one a tile at a time.
    step = n if n * k <= WHOLE_ELEMENTS else max(1, TILE_ELEMENTS // max(k, 1))
    tile = torch.empty((min(step, n), k), dtype=x.dtype)
    if step >= n and out.dtype == x.dtype and out.is_contiguous():
        dequantize_rows(weight, 0, n, tile, lib)
        torch.matmul(x, tile.t(), out=out)
        return
    for start in range(0, n, step):
        stop = min(n, start + step)
        part = tile[: stop - start]
        dequantize_rows(weight, start, stop, part, lib)
        out[:, start:stop] = x @ part.t()
