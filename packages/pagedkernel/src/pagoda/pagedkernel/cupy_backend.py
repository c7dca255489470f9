"""The CuPy backend (`CupyBackend`): CUDA C kernels (`csrc/*.cu`) compiled at run time by NVRTC, through cupy.

Tensors stay torch tensors: kernels receive their raw `data_ptr()`s and run on the current torch CUDA stream,
so no dlpack conversion is needed (cupy has no bfloat16 dtype anyway). Each kernel file is compiled once per
(dtype, head_dim, device) with the options of `cupy_kernels` and kept by `functools.cache`, the only state of
this module; cupy also caches the binaries on disk (~/.cupy/kernel_cache) across processes.

Kernels (see the .cu files for the details):
- reshape_and_cache: one thread block per token.
- paged attention: one thread block per (query row, head, key partition) with an online softmax; decode splits
  long contexts into partitions merged by a reduce kernel when there are too few rows to fill the GPU; prefill
  runs the same kernel with one row per query token (each seeing the keys up to its own position).
- copy_blocks: every layer in one launch, the layers' cache addresses passed as arrays of pointers.
- swap_blocks: one `cudaMemcpyAsync` per block (a host<->device copy is a DMA, not a kernel), as vLLM does.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from pagoda.pagedkernel import csrc, cupy_kernels
from pagoda.pagedkernel.kv_quant import FP8_DTYPES
from pagoda.pagedkernel.torch_backend import QUANTIZED_DTYPES, TorchBackend, check_scales
from torch import Tensor

try:
    import cupy
    import numpy as np
except ImportError as exc:  # the registry turns this into BackendUnavailableError
    raise ImportError(
        "the cupy kernel backend needs CuPy: pip install cupy-cuda12x (or 'pagoda-pagedkernel[cupy]')"
    ) from exc

_CACHE_THREADS = 256
_ATTENTION_THREADS = 128  # NUM_THREADS in paged_attention.cu
# Decode keys per partition when a context is split, and the most partitions (which bounds the float32
# workspace to num_seqs * num_heads * _MAX_PARTITIONS * head_dim).
_PARTITION_SIZE = 512
_MAX_PARTITIONS = 64
# Split decode contexts only while (rows * heads) thread blocks leave SMs idle: fewer than this many per SM.
_BLOCKS_PER_SM_TO_SPLIT = 4


@functools.cache
def _module(file: str, dtype: torch.dtype, head_dim: int | None, int8_cache: bool = False) -> Any:
    """The RawModule of kernel file `file` specialised to dtype (and head_dim, int8 caches); NVRTC runs on first
    use."""
    options = cupy_kernels.compile_options(dtype, head_dim, int8_cache=int8_cache)
    return cupy.RawModule(code=csrc.read_source(file), options=options)


@functools.cache
def _kernel(
    file: str,
    name: str,
    dtype: torch.dtype,
    head_dim: int | None,
    device_index: int,
    int8_cache: bool = False,
) -> Any:
    """Kernel `name` of `file` specialised to dtype (and head_dim, int8 caches), loaded on one device."""
    with cupy.cuda.Device(device_index):
        return _module(file, dtype, head_dim, int8_cache).get_function(name)


@functools.cache
def _sm_count(device_index: int) -> int:
    """Number of streaming multiprocessors of a CUDA device."""
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _launch(kernel: Any, device_index: int, grid: tuple[int, ...], block: int, args: tuple[Any, ...]) -> None:
    """Launch `kernel` on `device_index` in torch's current stream there, so it is ordered with torch's work."""
    stream = torch.cuda.current_stream(device_index).cuda_stream
    with cupy.cuda.Device(device_index), cupy.cuda.ExternalStream(stream, device_index):
        kernel(grid, (block,), args)


def _i32(value: int) -> Any:
    """A kernel `int` argument (cupy passes a Python int as 8 bytes; numpy raises if it does not fit)."""
    return np.int32(value)


def _f32(value: float) -> Any:
    """A kernel `float` argument (cupy passes a Python float as a double)."""
    return np.float32(value)


def _device_index(t: Tensor) -> int:
    """The CUDA device index of `t`, refusing CPU tensors with a clear message."""
    if not t.is_cuda:
        raise ValueError(f"the cupy kernel backend runs on CUDA tensors, got one on {t.device}")
    return t.get_device()


def _check_caches(k_cache: Tensor, v_cache: Tensor) -> None:
    """The kernels index caches as dense [num_blocks, block_size, num_kv_heads, head_dim] arrays."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must be 4-d and alike, got {k_cache.shape} and {v_cache.shape}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the cupy kernels need contiguous KV caches")


def _last_dim_dense(t: Tensor) -> Tensor:
    """`t` itself when its last dimension is contiguous (the kernels take the other strides), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _num_partitions(num_work_blocks: int, span: int, device: int) -> int:
    """How many partitions to split each decode row's keys into (1 when rows * heads already fill the GPU)."""
    if span <= _PARTITION_SIZE or num_work_blocks >= _BLOCKS_PER_SM_TO_SPLIT * _sm_count(device):
        return 1
    return min(math.ceil(span / _PARTITION_SIZE), _MAX_PARTITIONS)


def _attention(
    q: Tensor,  # [num_rows, num_heads, head_dim]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: Tensor | None,  # int32 [num_seqs + 1] (prefill), None for decode (row = sequence)
    context_lens: Tensor,  # int32 [num_seqs]
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    out: Tensor | None,  # [num_rows, num_heads, head_dim]
    k_scale: Tensor | None = None,  # bfloat16 [num_blocks, num_kv_heads, head_dim], int8 caches only
    v_scale: Tensor | None = None,  # float32 [num_blocks, block_size, num_kv_heads], int8 caches only
) -> Tensor:  # [num_rows, num_heads, head_dim]
    """Shared launcher of decode and prefill attention."""
    _check_caches(k_cache, v_cache)
    check_scales(k_cache, v_cache, k_scale, v_scale)
    int8 = k_scale is not None and v_scale is not None
    if k_scale is not None and v_scale is not None:  # contiguous, as the kernel indexes them
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    expected = torch.int8 if int8 else q.dtype
    if q.dim() != 3 or q.shape[-1] != k_cache.shape[-1] or k_cache.dtype != expected:
        raise ValueError(f"q {q.shape} {q.dtype} does not match the cache {k_cache.shape} {k_cache.dtype}")
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if logit_softcap is not None and logit_softcap <= 0:
        raise ValueError(f"logit_softcap must be positive, got {logit_softcap}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a {q.shape} {q.dtype} tensor with a contiguous last dim")
    if num_rows == 0:
        return out
    device = _device_index(q)
    q = _last_dim_dense(q)
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    starts = None if query_start_loc is None else query_start_loc.to(torch.int32).contiguous()
    # Decode rows are sequences; prefill rows find their sequence among query_start_loc's num_seqs + 1 bounds.
    num_seqs = num_rows if starts is None else starts.shape[0] - 1
    if tables.dim() != 2 or tables.shape[0] < num_seqs or lens.shape[0] < num_seqs:
        raise ValueError(
            f"{num_seqs} sequences need as many block_tables rows and context_lens, "
            f"got {tuple(tables.shape)} and {tuple(lens.shape)}"
        )

    # Upper bound on the keys any row sees, known without reading context_lens back from the device.
    span = tables.shape[1] * block_size
    if sliding_window is not None:
        span = min(span, sliding_window)
    partitions = 1 if starts is not None else _num_partitions(num_rows * num_heads, span, device)
    partition_size = max(1, math.ceil(span / partitions))
    if partitions > 1:
        part_out = torch.empty(
            (num_rows, num_heads, partitions, head_dim), dtype=torch.float32, device=q.device
        )
        part_stats = torch.empty((2, num_rows, num_heads, partitions), dtype=torch.float32, device=q.device)
        part_ptrs = (part_out.data_ptr(), part_stats[0].data_ptr(), part_stats[1].data_ptr())
    else:
        part_ptrs = (0, 0, 0)  # null: the kernel writes `out` directly

    kernel = _kernel(
        cupy_kernels.ATTENTION_FILE, cupy_kernels.PAGED_ATTENTION, q.dtype, head_dim, device, int8
    )
    args = (
        out.data_ptr(),
        *part_ptrs,
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        0 if k_scale is None else k_scale.data_ptr(),  # null: a float cache
        0 if v_scale is None else v_scale.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        0 if starts is None else starts.data_ptr(),
        _i32(num_seqs),
        _i32(q.stride(0)),
        _i32(q.stride(1)),
        _i32(out.stride(0)),
        _i32(out.stride(1)),
        _i32(num_heads),
        _i32(num_kv_heads),
        _i32(block_size),
        _i32(tables.shape[1]),
        _f32(scale),
        _f32(0.0 if logit_softcap is None else logit_softcap),  # 0 = off in the kernel
        _i32(0 if sliding_window is None else sliding_window),  # 0 = off in the kernel
        _i32(partition_size),
    )
    _launch(kernel, device, (num_rows * num_heads, partitions), _ATTENTION_THREADS, args)
    if partitions > 1:
        reduce = _kernel(
            cupy_kernels.ATTENTION_FILE, cupy_kernels.PAGED_ATTENTION_REDUCE, q.dtype, head_dim, device
        )
        reduce_args = (
            out.data_ptr(),
            *part_ptrs,
            _i32(out.stride(0)),
            _i32(out.stride(1)),
            _i32(num_heads),
            _i32(partitions),
        )
        _launch(reduce, device, (num_rows * num_heads,), _ATTENTION_THREADS, reduce_args)
    return out


class CupyBackend:
    """The five ops as CUDA C kernels compiled by NVRTC, launched on torch's current stream (CUDA tensors only)."""

    __slots__ = ()
    name = "cupy"

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
        """Write each token's key and value into cache slot `slot_mapping[t]`, skipping negative slots."""
        if k_cache.dtype in QUANTIZED_DTYPES:  # quantized caches run the torch reference on this device
            TorchBackend().reshape_and_cache(
                key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
            )
            return
        _check_caches(k_cache, v_cache)
        if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:]:
            raise ValueError(f"key {key.shape} / value {value.shape} do not match the cache {k_cache.shape}")
        num_tokens, num_kv_heads, head_dim = key.shape
        if num_tokens == 0:
            return
        device = _device_index(k_cache)
        key = _last_dim_dense(key.to(k_cache.dtype))
        value = _last_dim_dense(value.to(k_cache.dtype))
        slots = slot_mapping.to(torch.int64).contiguous()
        kernel = _kernel(
            cupy_kernels.CACHE_OPS_FILE, cupy_kernels.RESHAPE_AND_CACHE, k_cache.dtype, None, device
        )
        args = (
            key.data_ptr(),
            value.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr(),
            _i32(key.stride(0)),
            _i32(key.stride(1)),
            _i32(value.stride(0)),
            _i32(value.stride(1)),
            _i32(num_kv_heads),
            _i32(head_dim),
        )
        _launch(kernel, device, (num_tokens,), _CACHE_THREADS, args)

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
    ) -> Tensor:  # [num_seqs, num_heads, head_dim]
        """Attention of one query per sequence, at position context_lens[i] - 1, over its paged K/V."""
        if k_cache.dtype in FP8_DTYPES:  # fp8 caches run the torch reference on this device (int8: native)
            return TorchBackend().paged_decode_attention(
                q,
                k_cache,
                v_cache,
                block_tables,
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
            None,
            context_lens,
            scale,
            sliding_window,
            logit_softcap,
            out,
            k_scale,
            v_scale,
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
    ) -> Tensor:  # [total_query_tokens, num_heads, head_dim]
        """Causal attention of each sequence's last q_len tokens (rows query_start_loc[i]:[i+1]) over all of them."""
        if k_cache.dtype in FP8_DTYPES:  # fp8 caches run the torch reference on this device (int8: native)
            return TorchBackend().paged_prefill_attention(
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
            k_scale,
            v_scale,
        )

    def copy_blocks(
        self,
        k_caches: list[Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        v_caches: list[Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        block_pairs: Tensor,  # int64 [num_pairs, 2] (src, dst)
    ) -> None:
        """Copy block src to block dst in every layer's K and V cache in one launch (dst blocks are not sources)."""
        if len(k_caches) != len(v_caches):
            raise ValueError(f"{len(k_caches)} K caches but {len(v_caches)} V caches")
        if block_pairs.numel() == 0 or not k_caches:
            return
        first = k_caches[0]
        for cache in [*k_caches, *v_caches]:
            if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
                raise ValueError(
                    "copy_blocks needs every layer's caches to share one shape, dtype and device"
                )
            if not cache.is_contiguous():
                raise ValueError("the cupy kernels need contiguous KV caches")
        device = _device_index(first)
        # [2, num_layers]: row 0 the K caches' addresses, row 1 the V caches'.
        addresses = torch.tensor(
            [[c.data_ptr() for c in k_caches], [c.data_ptr() for c in v_caches]],
            dtype=torch.int64,
            device=first.device,
        )
        pairs = block_pairs.to(device=first.device, dtype=torch.int64).contiguous()
        kernel = _kernel(cupy_kernels.CACHE_OPS_FILE, cupy_kernels.COPY_BLOCKS, first.dtype, None, device)
        args = (addresses[0].data_ptr(), addresses[1].data_ptr(), pairs.data_ptr(), _i32(first[0].numel()))
        _launch(kernel, device, (pairs.shape[0], len(k_caches)), _CACHE_THREADS, args)

    def swap_blocks(
        self,
        src: Tensor,  # [num_blocks_src, block_size, num_kv_heads, head_dim]
        dst: Tensor,  # [num_blocks_dst, block_size, num_kv_heads, head_dim]
        block_pairs: Tensor,  # int64 [num_pairs, 2] (src block, dst block)
    ) -> None:
        """Copy blocks between two caches (host<->device or within a device), one `cudaMemcpyAsync` per block.

        The copies are queued on the current torch stream; with a pinned host cache they are asynchronous, so
        synchronise before reading a host destination on the CPU (as with the torch backend's non_blocking copies).
        """
        if block_pairs.numel() == 0:
            return
        if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
            raise ValueError(
                f"swap_blocks needs alike blocks, got {src.shape} {src.dtype} and {dst.shape} {dst.dtype}"
            )
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise ValueError("swap_blocks needs contiguous caches")
        device = _device_index(src if src.is_cuda else dst)
        pairs = block_pairs.tolist()  # the addresses are computed on the host: one read-back if on the GPU
        for s, d in pairs:
            if not (0 <= s < src.shape[0] and 0 <= d < dst.shape[0]):
                raise IndexError(
                    f"block pair ({s}, {d}) is out of range for {src.shape[0]} -> {dst.shape[0]} blocks"
                )
        block_bytes = src[0].numel() * src.element_size()
        src_base, dst_base = src.data_ptr(), dst.data_ptr()
        stream = torch.cuda.current_stream(device).cuda_stream
        with cupy.cuda.Device(device):
            for s, d in pairs:
                cupy.cuda.runtime.memcpyAsync(
                    dst_base + d * block_bytes,
                    src_base + s * block_bytes,
                    block_bytes,
                    cupy.cuda.runtime.memcpyDefault,
                    stream,
                )
