"""The cpu backend (`CpuBackend`): paged attention by a C kernel (`csrc/cpu_attention.c`) built for this CPU.

The torch backend attends by gathering every sequence's K/V blocks into a padded copy and running SDPA on it;
this kernel instead reads each block once, in place, through the block table, with an online softmax (see the
C file). Measured on a 2-core AMD EPYC, float32, 110 decodes of 300-500 keys (Gemma 3 270M's attention shape):
11.6 ms against the torch backend's 41.3 ms per layer.

The kernel is compiled at first use, per dtype (float32, float16, bfloat16), by `cbuild` (the system's C
compiler, the library cached on disk) with this module's flags: `-O3 -march=native -fopenmp` (its threads are
torch's OpenMP pool; pthreads where the compiler has no OpenMP), like CuPy compiles its CUDA sources at run
time; it is loaded with ctypes (the call releases the GIL). `CpuBackend` is the torch backend with its attention
and `reshape_and_cache` overridden: attention this kernel does not take (another device, a q dtype that differs
from the cache's, head_dim not a multiple of 8 or above 512, block_size above 256, more than 32 query heads per
KV head) runs through the torch backend. `reshape_and_cache` is a C loop of one memcpy per row (torch's
index_copy_ took ~0.3 ms per layer for a decode batch); block copies and swaps are the torch backend's.

A cached library that fails to load (a damaged file) is deleted and compiled once more (`cbuild.load_or_rebuild`);
if that one fails to load too, or cannot be compiled, that dtype runs on the torch backend's kernels, with a
warning naming the library. The engine builds
every dtype it uses at start-up (`prepare`), so no first forward waits for the compiler.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pagoda.pagedkernel import cbuild, csrc
from pagoda.pagedkernel.backend import BackendUnavailableError
from pagoda.pagedkernel.torch_backend import TorchBackend, check_attention_args, check_scales
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE_FILE = "cpu_attention.c"
ATTENTION = "pagoda_paged_attention"
RESHAPE_AND_CACHE = "pagoda_reshape_and_cache"
RESHAPE_AND_CACHE_INT8 = "pagoda_reshape_and_cache_int8"  # only in the int8-cache builds (-DPAGODA_KV_INT8)
# -fno-math-errno lets expf/tanhf inline; no -ffast-math: the softmax relies on -inf and IEEE exp.
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-pthread")
# Tried first: OpenMP, so the kernel runs on torch's thread pool (libgomp.so.1 is already loaded by torch);
# a compiler without OpenMP builds the pthreads version instead.
OPENMP_FLAGS = ("-fopenmp",)
MAX_HEAD_DIM = 512
MAX_BLOCK_SIZE = 256
MAX_GROUP = 32  # query heads per KV head (MAX_ROWS in the C file)


@dataclass(frozen=True, slots=True)
class CpuKernels:
    """The entry points of one compiled library (see the C file for their contracts)."""

    attention: Callable[..., int]
    reshape_and_cache: Callable[..., int]
    reshape_and_cache_int8: Callable[..., int] | None = None  # the int8-cache builds' write


def build(dtype: torch.dtype, *, int8_cache: bool = False, cflags: tuple[str, ...] = CFLAGS) -> Path:
    """Compile the kernel for `dtype` (activations; with `int8_cache` over int8 caches with scales) unless the
    cache has it (see `cbuild.build`); the path of the shared library. `cflags` (e.g. another -march, to test the
    generic C path on an AVX2 machine) replaces the default flags.

    Raises BackendUnavailableError (with the compiler's output) when there is no compiler or it fails.
    """
    int8_flags = ("-DPAGODA_KV_INT8=1",) if int8_cache else ()
    return cbuild.build(
        SOURCE_FILE,
        csrc.read_source(SOURCE_FILE),
        (*cflags, f"-DPAGODA_DTYPE={csrc.DTYPE_IDS[dtype]}", *int8_flags),
        variant=str(dtype).removeprefix("torch.") + ("-int8kv" if int8_cache else ""),
        owner="the 'cpu' kernel backend",
        instead="use kernel_backend='torch'",
        alternatives=(OPENMP_FLAGS, ()),
        libraries=("-lm",),
    )


def load(library: Path, *, int8_cache: bool = False) -> CpuKernels:
    """The entry points of a shared library that `build` made, with their C signatures declared."""
    lib = ctypes.CDLL(str(library))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    attention = lib[ATTENTION]
    argtypes: list[Any] = [ptr] * 7 + [i64, ptr, ptr] + [i64] * 6 + [ctypes.c_float] * 2 + [i64]
    attention.argtypes = argtypes
    attention.restype = ctypes.c_int
    cache = lib[RESHAPE_AND_CACHE]
    cache.argtypes = [ptr] * 5 + [i64] * 5
    cache.restype = i64
    if not int8_cache:
        return CpuKernels(attention, cache)
    cache_int8 = lib[RESHAPE_AND_CACHE_INT8]
    cache_int8.argtypes = [ptr] * 7 + [i64] * 7
    cache_int8.restype = i64
    return CpuKernels(attention, cache, cache_int8)


def _load_or_rebuild(dtype: torch.dtype, int8_cache: bool = False) -> CpuKernels | None:
    """Load the library for `dtype` by `cbuild.load_or_rebuild`'s rule; None (the torch kernels, with a warning)
    when it is damaged and compiling it again did not mend it."""
    try:
        return cbuild.load_or_rebuild(
            lambda: build(dtype, int8_cache=int8_cache),
            (lambda library: load(library, int8_cache=True)) if int8_cache else load,
            owner="the 'cpu' kernel backend",
        )
    except cbuild.DamagedLibraryError as exc:
        logger.warning("%s: %s attention runs on the torch kernels", exc, dtype)
        return None


def _token_rows(x: Tensor) -> Tensor:  # [num_tokens, num_kv_heads, head_dim], each token's row contiguous
    """x itself when each token's [num_kv_heads, head_dim] is one contiguous row (any token stride), else a copy."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def supported(q: Tensor, k_cache: Tensor) -> bool:
    """Whether the C kernel takes attention of q over this cache (else the torch backend runs it)."""
    num_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    return (
        q.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and k_cache.dtype in (q.dtype, torch.int8)
        and q.dtype in csrc.DTYPE_IDS
        and head_dim % 8 == 0
        and head_dim <= MAX_HEAD_DIM
        and k_cache.shape[1] <= MAX_BLOCK_SIZE
        and num_heads // num_kv_heads <= MAX_GROUP
        and k_cache.is_contiguous()
    )


def _attention(
    q: Tensor,  # [total_query_tokens, num_heads, head_dim]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: Tensor,  # int32 [num_seqs + 1]
    context_lens: Tensor,  # int32 [num_seqs]
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    out: Tensor | None,  # [total_query_tokens, num_heads, head_dim]
    kernels: CpuKernels,  # built for q's dtype (and an int8 cache's when k_scale is given)
    k_scale: Tensor | None = None,  # bfloat16 [num_blocks, num_kv_heads, head_dim] of an int8 cache
    v_scale: Tensor | None = None,  # float32 [num_blocks, block_size, num_kv_heads] of an int8 cache
) -> Tensor:  # [total_query_tokens, num_heads, head_dim]
    """Run the C kernel; its int and layout arguments are made contiguous int32 here, as it reads raw pointers."""
    assert v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype, "the V cache must match the K cache"
    scales = [s.contiguous() for s in (k_scale, v_scale) if s is not None]
    scale_ptrs = [s.data_ptr() for s in scales] if scales else [None, None]
    q = q.contiguous()
    result = out if out is not None and out.is_contiguous() and out.dtype == q.dtype else torch.empty_like(q)
    tables = block_tables.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    num_seqs = lens.shape[0]
    assert starts.shape[0] == num_seqs + 1 and tables.shape[0] >= num_seqs, (starts.shape, tables.shape)
    status = kernels.attention(
        q.data_ptr(),
        result.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        *scale_ptrs,
        tables.data_ptr(),
        tables.shape[1],
        starts.data_ptr(),
        lens.data_ptr(),
        num_seqs,
        q.shape[1],
        k_cache.shape[2],
        k_cache.shape[3],
        k_cache.shape[1],
        sliding_window or 0,
        scale,
        logit_softcap or 0.0,
        torch.get_num_threads(),
    )
    if status == 2:
        raise MemoryError("the 'cpu' attention kernel could not allocate its work list")
    if status != 0:
        raise RuntimeError(f"the 'cpu' attention kernel refused its arguments (status {status})")
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result


class CpuBackend(TorchBackend):
    """The torch backend with attention and `reshape_and_cache` in C where the kernel takes them.

    Holds the libraries it loaded, one per dtype (built, or found in the on-disk cache, at first use); None for a
    dtype whose library would not load, which then runs on the torch kernels.
    """

    __slots__ = ("_loaded",)
    name = "cpu"

    def __init__(self) -> None:
        # Keyed by (activation dtype, whether the caches are int8 with scales).
        self._loaded: dict[tuple[torch.dtype, bool], CpuKernels | None] = {}

    def kernels(self, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> CpuKernels | None:
        """The compiled kernels for `dtype` (over caches of `cache_dtype`, default the same; int8 is the other
        build), built (or found in the cache) and loaded once per backend; None when the library failed to load
        even after one rebuild (the torch kernels run instead).

        Raises BackendUnavailableError when there is no compiler or it fails."""
        key = (dtype, cache_dtype == torch.int8)
        if key not in self._loaded:
            self._loaded[key] = _load_or_rebuild(*key)
        return self._loaded[key]

    def prepare(self, dtypes: Iterable[torch.dtype], cache_dtype: torch.dtype | None = None) -> None:
        """Build and load the kernels of every dtype the engine will run (over caches of `cache_dtype`, default
        the same dtype), before its first step."""
        for dtype in dtypes:
            if dtype in csrc.DTYPE_IDS and cache_dtype in (None, dtype, torch.int8):
                self.kernels(dtype, cache_dtype)

    def loaded_dtypes(self) -> frozenset[torch.dtype]:
        """The activation dtypes whose kernels were built (or refused, then left to torch) so far."""
        return frozenset(dtype for dtype, _ in self._loaded)

    def available(self) -> bool:
        """Whether the float32 kernel compiles and loads here (what get_backend('auto') asks on a CPU)."""
        try:
            return self.kernels(torch.float32) is not None
        except (BackendUnavailableError, OSError) as exc:
            logger.warning("the 'cpu' kernel backend is unavailable, attention runs through torch: %s", exc)
            return False

    def reshape_and_cache(
        self,
        key: Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: Tensor,  # int64 [num_tokens], negative = padding
        *,
        k_scale: Tensor | None = None,  # bfloat16 [num_blocks, num_kv_heads, head_dim], int8 caches only
        v_scale: Tensor | None = None,  # float32 [num_blocks, block_size, num_kv_heads], int8 caches only
    ) -> None:
        """Write each token's key and value into cache slot `slot_mapping[t]`, skipping negative slots (an int8
        cache quantizes them, kv_quant's rule, in C)."""
        if k_cache.dtype == torch.int8:
            self._write_int8(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            return
        native = (
            key.device.type == "cpu"
            and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
            and k_cache.dtype in csrc.DTYPE_IDS
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and key.shape[1:] == value.shape[1:] == k_cache.shape[2:] == v_cache.shape[2:]
            and k_cache.shape == v_cache.shape
        )
        kernels = self.kernels(k_cache.dtype) if native else None
        if kernels is None:
            super().reshape_and_cache(
                key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
            )
            return
        key, value = _token_rows(key), _token_rows(value)
        slots = slot_mapping.to(torch.int64).contiguous()
        assert slots.shape == key.shape[:1] == value.shape[:1], (slots.shape, key.shape, value.shape)
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        row = k_cache.shape[2] * k_cache.shape[3]
        bad = kernels.reshape_and_cache(
            key.data_ptr(),
            value.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr(),
            key.shape[0],
            num_slots,
            row,
            key.stride(0),
            value.stride(0),
        )
        if bad:
            raise IndexError(
                f"slot {int(slots[bad - 1])} of token {bad - 1} is outside the cache's {num_slots} slots"
            )

    def _write_int8(
        self,
        key: Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: Tensor,  # int8 [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # int8 [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: Tensor,  # int64 [num_tokens], negative = padding
        k_scale: Tensor | None,  # bfloat16 [num_blocks, num_kv_heads, head_dim]
        v_scale: Tensor | None,  # float32 [num_blocks, block_size, num_kv_heads]
    ) -> None:
        """The int8 write in C where it takes the inputs, else the torch reference's."""
        check_scales(k_cache, v_cache, k_scale, v_scale)
        assert k_scale is not None and v_scale is not None
        native = (
            key.device.type == "cpu"
            and key.dtype == value.dtype
            and key.dtype in csrc.DTYPE_IDS
            and all(t.is_contiguous() for t in (k_cache, v_cache, k_scale, v_scale))
            and key.shape[1:] == value.shape[1:] == k_cache.shape[2:]
            and k_cache.shape == v_cache.shape
            and k_cache.shape[3] <= MAX_HEAD_DIM  # the C write's scratch row
        )
        kernels = self.kernels(key.dtype, torch.int8) if native else None
        if kernels is None or kernels.reshape_and_cache_int8 is None:
            super().reshape_and_cache(
                key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
            )
            return
        key, value = _token_rows(key), _token_rows(value)
        slots = slot_mapping.to(torch.int64).contiguous()
        assert slots.shape == key.shape[:1] == value.shape[:1], (slots.shape, key.shape, value.shape)
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        bad = kernels.reshape_and_cache_int8(
            key.data_ptr(),
            value.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_scale.data_ptr(),
            v_scale.data_ptr(),
            slots.data_ptr(),
            key.shape[0],
            num_slots,
            k_cache.shape[1],
            k_cache.shape[2],
            k_cache.shape[3],
            key.stride(0),
            value.stride(0),
        )
        if bad:
            raise IndexError(
                f"slot {int(slots[bad - 1])} of token {bad - 1} is outside the cache's {num_slots} slots"
            )

    def paged_decode_attention(
        self,
        q: Tensor,  # [num_seqs, num_heads, head_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
        context_lens: Tensor,  # int32 [num_seqs]
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: Tensor | None = None,  # [num_seqs, num_heads, head_dim]
        k_scale: Tensor | None = None,  # bfloat16 [num_blocks, num_kv_heads, head_dim], int8 caches only
        v_scale: Tensor | None = None,  # float32 [num_blocks, block_size, num_kv_heads], int8 caches only
    ) -> Tensor:
        """Attention of one query per sequence, at position context_lens[i] - 1, over its paged K/V: the prefill op
        with one query row per sequence (the C kernel's decode items are its one-token tiles)."""
        starts = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        return self.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            starts,
            context_lens,
            scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            out=out,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def paged_prefill_attention(
        self,
        q: Tensor,  # [total_query_tokens, num_heads, head_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
        query_start_loc: Tensor,  # int32 [num_seqs + 1]
        context_lens: Tensor,  # int32 [num_seqs]
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: Tensor | None = None,  # [total_query_tokens, num_heads, head_dim]
        k_scale: Tensor | None = None,  # bfloat16 [num_blocks, num_kv_heads, head_dim], int8 caches only
        v_scale: Tensor | None = None,  # float32 [num_blocks, block_size, num_kv_heads], int8 caches only
    ) -> Tensor:
        """Causal attention of each sequence's last q_len tokens (rows query_start_loc[i]:[i+1]) over all of them."""
        check_attention_args(q, k_cache, v_cache, k_scale, v_scale)
        kernels = self.kernels(q.dtype, k_cache.dtype) if supported(q, k_cache) else None
        if kernels is None:
            return super().paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                block_tables,
                query_start_loc,
                context_lens,
                scale,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
                out=out,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return _attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            query_start_loc,
            context_lens,
            scale,
            sliding_window,
            logit_softcap,
            out,
            kernels,
            k_scale,
            v_scale,
        )
