"""csrc/cpu_decode.c compiled per dtype at first use by `cbuild`, loaded with ctypes, and the layer table it reads."""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pagoda.pagedkernel import cbuild, csrc
from pagoda.pagedkernel.backend import BackendUnavailableError
from pagoda.pagedkernel.fused import ActivationName
from pagoda.pagedkernel.quant import cpu_quant
from pagoda.pagedkernel.quant.formats import BLOCK_SIZES, REPACKED_TYPES, QuantizedTensor
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE_FILE = "cpu_decode.c"
# The quantized GEMV's and the fused ops' flags (no FMA contraction: they round where their references do); the
# attention part of the file restores contraction itself, as its own library is built. -pthread: the attention
# kernel's fallback without OpenMP.
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-pthread")
DTYPES = (torch.float32, torch.bfloat16)
# Rows one call takes (the C file's DECODE_MAX_ROWS, the same number: tests/pagedkernel/test_decode_layers.py holds
# them together). Each weight multiplies them as qmatmul would: up to GEMV_MAX_ROWS on the int8 GEMV, past it a
# row-major part on the vector path (its panel code, which the C file calls) and a repacked one on its int8 tiles.
MAX_ROWS = 64
OWNER = "the native decode layers"
# The GGUF formats cpu_quant.c's GEMV columns multiply.
SUPPORTED_QTYPES = cpu_quant.GEMV_QTYPES | REPACKED_TYPES


@dataclass(frozen=True, slots=True)
class DecodeKernels:
    """One dtype's library: `run` is pagoda_decode_layers (see the C file), `fields` and `max_parts` its table's
    layout."""

    run: Any
    fields: int
    max_parts: int


def build(dtype: torch.dtype, flags: tuple[str, ...] = CFLAGS) -> Path:
    """The library for `dtype` built with `flags` (e.g. another -march, to test a path), unless cached.

    Raises BackendUnavailableError (CompileError with the compiler's output) when there is no compiler or it fails.
    """
    return csrc.build_for_dtype(
        SOURCE_FILE, dtype, flags, owner=OWNER, instead="run the torch layers", libraries=("-lm",)
    )


def load(library: Path) -> DecodeKernels:
    """The entry points of a library that `build` made, with their C signatures declared."""
    lib = ctypes.CDLL(str(library))
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    run = lib["pagoda_decode_layers"]
    # (table, layers, x, rows, hidden, heads, kv_heads, head_dim, inner, block_size, eps, scale, unit_offset,
    #  act_kind, softcap, cos, sin, slots, block_tables, max_blocks, context_lens, query_start_loc, num_seqs,
    #  threads, prefetch, final_norm)
    run.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, i64, i64, i64, f32, f32, i64, i64, f32]
    run.argtypes += [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, ptr]
    run.restype = ctypes.c_int
    fields, parts = lib["pagoda_decode_layer_fields"], lib["pagoda_decode_max_parts"]
    fields.restype = parts.restype = i64
    return DecodeKernels(run, int(fields()), int(parts()))


@functools.cache
def kernels(dtype: torch.dtype) -> DecodeKernels:
    """This CPU's library for `dtype`, built or found in the cache and loaded once per process."""
    return cbuild.load_or_rebuild(lambda: build(dtype), load, owner=OWNER)


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Whether the library for `dtype` builds and loads here (checked once; a warning says why not)."""
    if dtype not in DTYPES:
        return False
    try:
        kernels(dtype)
    except (BackendUnavailableError, OSError) as exc:
        logger.warning("the decode layers run as torch modules: %s", exc)
        return False
    return True


def supports_weight(parts: Sequence[QuantizedTensor], max_parts: int = 3) -> bool:
    """Whether a weight's runs of rows are ones the C GEMV multiplies (formats, count, K a multiple of blocks)."""
    if not 1 <= len(parts) <= max_parts:
        return False
    # The layers claim columns in runs on multiples of 16 from the weight's first row: a repacked part's tiles stay
    # whole when every part's rows are a multiple of 16.
    if any(p.qtype in REPACKED_TYPES for p in parts) and any(p.shape[0] % 16 for p in parts):
        return False
    for part in parts:
        if part.qtype not in SUPPORTED_QTYPES or len(part.shape) != 2 or part.data.device.type != "cpu":
            return False
        if part.shape[1] % BLOCK_SIZES[part.qtype][0] or not part.data.is_contiguous():
            return False
    return True


# The activations the C file applies to the gate (its `act_kind` codes).
ACTIVATIONS: dict[ActivationName, int] = {"gelu_tanh": 0, "silu": 1}


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """The sizes and forms every layer shares."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    inner: int  # the MLP's intermediate size
    eps: float  # the RMSNorms'
    scale: float  # attention's q . k factor
    unit_offset: bool = False  # Gemma's (1 + w) norms, else Llama's w * x_hat
    activation: ActivationName = "silu"  # the gate's (a key of ACTIVATIONS)
    logit_softcap: float | None = None  # attention's soft-capping, None: none


@dataclass(frozen=True, slots=True)
class DecodeLayer:
    """One decoder layer's tensors: RMSNorm weights, quantized projections (runs of rows) and its KV cache.

    Llama: x + o(attn(input_norm(x))), then x + down(act(gate_up(mlp_norm(x)))). Gemma 3 adds `attn_out_norm` on
    the attention branch and `mlp_out_norm` on the MLP branch before their residual adds, and `q_norm` / `k_norm`
    per head before rotary.
    """

    input_norm: Tensor  # [hidden], the activations' dtype
    mlp_norm: Tensor  # [hidden]: the residual's norm before the MLP
    qkv: Sequence[QuantizedTensor]  # [q + 2 kv, hidden] in runs
    o: Sequence[QuantizedTensor]  # [hidden, q]
    gate_up: Sequence[QuantizedTensor]  # [2 inner, hidden]
    down: Sequence[QuantizedTensor]  # [hidden, inner]
    k_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], the activations' dtype
    v_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    sliding_window: int | None
    attn_out_norm: Tensor | None = None  # [hidden]
    mlp_out_norm: Tensor | None = None  # [hidden]
    q_norm: Tensor | None = None  # [head_dim]
    k_norm: Tensor | None = None  # [head_dim]
    rope: int = 0  # which of the step's cos / sin tables
    group: int = 0  # which KV cache group's slots and block tables


class DecodeStack:
    """A model's decoder layers as the C call's table (built once; the tensors it points at are kept alive)."""

    def __init__(self, layers: Sequence[DecodeLayer], shape: DecodeShape, dtype: torch.dtype) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"the native decode layers run in {DTYPES}, not {dtype}")
        if shape.activation not in ACTIVATIONS:
            raise ValueError(f"activation {shape.activation!r}: one of {', '.join(ACTIVATIONS)}")
        self.lib = kernels(dtype)
        self.shape = shape
        self.dtype = dtype
        self.layers = tuple(layers)
        self.block_size = int(self.layers[0].k_cache.shape[1])
        self.num_ropes = 1 + max(layer.rope for layer in self.layers)
        self.num_groups = 1 + max(layer.group for layer in self.layers)
        self.table = torch.zeros((len(self.layers), self.lib.fields), dtype=torch.int64)
        for index, layer in enumerate(self.layers):
            self._describe(index, layer)

    def _describe(self, index: int, layer: DecodeLayer) -> None:
        """Row `index` of the table (see the F_* offsets of the C file)."""
        norms = (layer.input_norm, layer.attn_out_norm, layer.mlp_norm, layer.mlp_out_norm)
        head_norms = (layer.q_norm, layer.k_norm)
        for t in (*norms, *head_norms, layer.k_cache, layer.v_cache):
            if t is not None and (t.dtype != self.dtype or not t.is_contiguous()):
                raise ValueError(f"the native decode layers read contiguous {self.dtype} norms and caches")
        if int(layer.k_cache.shape[1]) != self.block_size:
            raise ValueError("every layer's KV cache must have one block size")
        row: list[int] = [0 if t is None else t.data_ptr() for t in (*norms, *head_norms)]
        row += [
            layer.k_cache.data_ptr(),
            layer.v_cache.data_ptr(),
            layer.sliding_window or 0,
            layer.rope,
            layer.group,
        ]
        for weight in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if not supports_weight(weight, self.lib.max_parts):
                raise ValueError("a weight's formats are not ones the native decode layers multiply")
            row.append(len(weight))
            for i in range(self.lib.max_parts):
                if i < len(weight):
                    part = weight[i]
                    row += [int(part.qtype), int(part.shape[0]), part.data.data_ptr()]
                else:
                    row += [0, 0, 0]
        self.table[index] = torch.tensor(row, dtype=torch.int64)

    def run(
        self,
        x: Tensor,  # [rows, hidden], contiguous: the residual stream, updated in place
        cos: Tensor,  # [num_ropes, rows, head_dim // 2] (or [rows, head_dim // 2] for one), x's dtype
        sin: Tensor,  # like cos
        slot_mapping: Tensor,  # int64 [num_groups, rows] (or [rows]): each row's cache slot, negative: none
        block_tables: Tensor,  # int32 [num_groups, num_seqs, max_blocks] (or [num_seqs, max_blocks])
        context_lens: Tensor,  # int32 [num_seqs]: tokens of each sequence including this step's
        num_threads: int | None = None,  # None: torch's
        prefetch: bool = True,  # ask for the next weights while a phase ends
        query_start_loc: Tensor | None = None,  # int32 [num_seqs + 1]; None: one row per sequence
        final_norm: Tensor | None = None,  # [hidden], x's dtype: the last norm's weight (shape's eps)
    ) -> None:
        """Every layer over the step's rows (sequence i's new tokens are rows query_start_loc[i]:[i + 1]: one in a
        decode step, a token and its drafts in a speculative one); x holds the last layer's output, or with
        `final_norm` its norm (bitwise the fused rms_norm op's, one Python op fewer a step)."""
        rows = int(x.shape[0])
        shape = self.shape
        if not 1 <= rows <= MAX_ROWS or x.dtype != self.dtype or not x.is_contiguous():
            raise ValueError(
                f"run takes 1..{MAX_ROWS} contiguous {self.dtype} rows, got {x.dtype} {tuple(x.shape)}"
            )
        half = shape.head_dim // 2
        if cos.dtype != x.dtype or sin.dtype != x.dtype or not cos.is_contiguous() or not sin.is_contiguous():
            cos, sin = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
        if cos.numel() != self.num_ropes * rows * half or sin.numel() != cos.numel():
            raise ValueError(f"cos and sin must hold {self.num_ropes} x {rows} x {half} values")
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
        slots, tables, lens = slots.contiguous(), block_tables.contiguous(), context_lens.contiguous()
        if query_start_loc is None:
            query_start_loc = torch.arange(rows + 1, dtype=torch.int32)
        starts = query_start_loc.contiguous()
        num_seqs = int(starts.numel()) - 1
        if starts.dtype != torch.int32 or num_seqs < 1:
            raise ValueError("query_start_loc is int32 [num_seqs + 1], at least one sequence")
        if final_norm is not None and (
            final_norm.dtype != x.dtype
            or final_norm.shape != (shape.hidden,)
            or not final_norm.is_contiguous()
        ):
            raise ValueError(f"final_norm must be a contiguous {x.dtype} [{shape.hidden}] weight")
        if slots.numel() != self.num_groups * rows:
            raise ValueError(f"slot_mapping must hold {self.num_groups} x {rows} slots")
        groups_seqs = tables.numel() // max(int(tables.shape[-1]), 1)
        if (
            tables.dtype != torch.int32
            or lens.dtype != torch.int32
            or groups_seqs != self.num_groups * num_seqs
        ):
            raise ValueError("block_tables and context_lens are int32, one table per group and sequence")
        if lens.numel() != num_seqs:
            raise ValueError(f"context_lens must hold {num_seqs} lengths, one per sequence")
        code = self.lib.run(
            self.table.data_ptr(),
            len(self.layers),
            x.data_ptr(),
            rows,
            shape.hidden,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.inner,
            self.block_size,
            shape.eps,
            shape.scale,
            int(shape.unit_offset),
            ACTIVATIONS[shape.activation],
            shape.logit_softcap or 0.0,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            int(tables.shape[-1]),
            lens.data_ptr(),
            starts.data_ptr(),
            num_seqs,
            torch.get_num_threads() if num_threads is None else num_threads,
            int(prefetch),
            None if final_norm is None else final_norm.data_ptr(),
        )
        if code == 2:
            raise MemoryError("the native decode layers could not allocate their work space")
        if code != 0:
            raise ValueError(
                f"the native decode layers refused the shapes {shape} or query_start_loc (status {code})"
            )
