"""The Triton backend (`TritonBackend`): launchers for the kernels in `triton_kernels`.

Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (the CPU tests). Launchers assert the layouts
the kernels assume (contiguous head_dim rows, contiguous caches) instead of silently copying.
"""

from __future__ import annotations

from typing import Any

import torch
from pagoda.pagedkernel import kv_quant
from pagoda.pagedkernel.backend import BackendUnavailableError, triton_interpreted
from pagoda.pagedkernel.torch_backend import TorchBackend, check_scales
from torch import Tensor

try:
    import triton
except ImportError as exc:  # pragma: no cover - exercised by the registry tests through find_spec
    raise BackendUnavailableError(
        "the 'triton' kernel backend needs Triton: pip install 'pagoda-pagedkernel[triton]'"
    ) from exc

from pagoda.pagedkernel import triton_kernels as kernels

# Decode splits contexts longer than this many tokens across programs and reduces the partial results.
DECODE_PARTITION_SIZE = 512
# Elements of one cache block copied per program in copy_blocks / swap_blocks.
_COPY_CHUNK = 1024


def _launch(kernel: Any, grid: tuple[int, ...], *args: object, **meta: object) -> None:
    """Launch `kernel` on `grid`; the one place kernels start (the compile test records launches here)."""
    kernel[grid](*args, **meta)


def _pow2(n: int, at_least: int = 1) -> int:
    """The next power of two >= max(n, at_least) (tl.arange and tl.dot need power-of-two tiles)."""
    return max(at_least, 1 << max(0, n - 1).bit_length())


def _check_cache(k_cache: Tensor, v_cache: Tensor) -> None:
    """Both caches contiguous, same shape and dtype: the kernels index them with one set of strides."""
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    assert k_cache.dtype == v_cache.dtype and k_cache.device == v_cache.device


def _check_rows(*tensors: Tensor) -> None:
    """Each token's [num_heads, head_dim] values are contiguous (the token stride may be anything)."""
    for t in tensors:
        assert t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2], (t.shape, t.stride())


def _attention_config(q: Tensor, k_cache: Tensor) -> tuple[int, int, bool]:
    """(head_dim padded to a power of two >= 16, GQA group size, whether the dots run in float32).

    float32 inputs keep full precision (no TF32). Under TRITON_INTERPRET=1, bfloat16 dots are also done in float32
    (after rounding the operands to bfloat16, as on the GPU): Triton 3.9's interpreter returns garbage for tl.dot
    on bfloat16 operands.
    """
    _check_rows(q)
    head_dim, num_heads, num_kv_heads = q.shape[2], q.shape[1], k_cache.shape[2]
    assert k_cache.shape[3] == head_dim, "head_dim of q and the cache differ"
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.dtype == k_cache.dtype or k_cache.dtype in (torch.int8, *kv_quant.FP8_DTYPES), (
        "q and the cache must share a dtype"
    )
    f32 = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and triton_interpreted())
    return _pow2(head_dim, 16), num_heads // num_kv_heads, f32


def _fp8_meta(dtype: torch.dtype) -> dict[str, float | int]:
    """The fp8 constexprs of reshape_and_cache_kernel for a cache dtype (none for other caches)."""
    if dtype not in kv_quant.FP8_DTYPES:
        return {}
    info = torch.finfo(dtype)
    mant = 3 if dtype == torch.float8_e4m3fn else 2
    return {
        "FP8_MAX": info.max,
        "FP8_MANT": mant,
        "FP8_MIN_NORMAL": info.tiny,
        "FP8_MAGIC": info.tiny * 2.0 ** (23 - mant),
    }


def _scale_args(
    k_cache: Tensor, v_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The scale pointers the attention kernels take: an int8 cache's contiguous scales, else the caches
    themselves (never read: INT8 is off)."""
    check_scales(k_cache, v_cache, k_scale, v_scale)
    if k_scale is None or v_scale is None:
        return k_cache, v_cache
    assert k_scale.device == k_cache.device and v_scale.device == k_cache.device
    return k_scale.contiguous(), v_scale.contiguous()


def _new_out(q: Tensor, out: Tensor | None) -> Tensor:
    """`out` checked against q, or a fresh tensor like q."""
    if out is None:
        return torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    _check_rows(out)
    return out


def decode_with_partitions(
    q: Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    context_lens: Tensor,  # int32 [num_seqs]
    scale: float,
    *,
    sliding_window: int | None,
    logit_softcap: float | None,
    out: Tensor | None,  # [num_seqs, num_heads, head_dim]
    partition_size: int,
    k_scale: Tensor | None = None,  # bfloat16 [num_blocks, num_kv_heads, head_dim], int8 caches only
    v_scale: Tensor | None = None,  # float32 [num_blocks, block_size, num_kv_heads], int8 caches only
) -> Tensor:
    """`paged_decode_attention` with an explicit partition size (the tests use small ones to split short contexts)."""
    _check_cache(k_cache, v_cache)
    k_scale_arg, v_scale_arg = _scale_args(k_cache, v_cache, k_scale, v_scale)
    head_dim_pad, group, f32 = _attention_config(q, k_cache)
    out = _new_out(q, out)
    num_seqs, num_heads, head_dim = q.shape
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert context_lens.dtype == torch.int32 and context_lens.is_contiguous()
    if num_seqs == 0:
        return out
    # The block table's width bounds every context without reading context_lens back to the host.
    max_keys = block_tables.shape[1] * k_cache.shape[1]
    if sliding_window is not None:
        max_keys = min(max_keys, sliding_window)
    num_partitions = triton.cdiv(max_keys, partition_size)
    tokens = 32 if head_dim_pad > 128 else 64
    part_shape = (num_seqs, num_heads, num_partitions)
    one = num_partitions == 1
    # One partition writes out directly; the scratch buffers are then never touched.
    part_acc = q.new_empty((*part_shape, head_dim_pad) if not one else (1,), dtype=torch.float32)
    part_max = q.new_empty(part_shape if not one else (1,), dtype=torch.float32)
    part_sum = q.new_empty(part_shape if not one else (1,), dtype=torch.float32)
    _launch(
        kernels.paged_decode_kernel,
        (num_seqs, k_cache.shape[2], num_partitions),
        out,
        part_acc,
        part_max,
        part_sum,
        q,
        k_cache,
        v_cache,
        k_scale_arg,
        v_scale_arg,
        block_tables,
        context_lens,
        scale,
        logit_softcap if logit_softcap is not None else 1.0,
        sliding_window if sliding_window is not None else 0,
        num_heads,
        num_partitions,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        GROUP=group,
        GROUP_PAD=_pow2(group, 16),
        BLOCK_SIZE=k_cache.shape[1],
        TOKENS=tokens,
        PARTITION=partition_size,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=logit_softcap is not None,
        ONE_PARTITION=one,
        F32=f32,
        INT8=k_scale is not None,
        num_warps=4,
    )
    if not one:
        _launch(
            kernels.paged_decode_reduce_kernel,
            (num_seqs, num_heads),
            out,
            part_acc,
            part_max,
            part_sum,
            num_heads,
            num_partitions,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            PARTITIONS_PAD=_pow2(num_partitions),
            num_warps=4,
        )
    return out


def _launch_copy(src: list[Tensor], dst: list[Tensor], block_pairs: Tensor) -> None:
    """One launch copying blocks src[i][pair[0]] -> dst[i][pair[1]] for every cache i and pair."""
    ref = src[0]
    for cache in [*src, *dst]:
        assert cache.is_contiguous() and cache.dtype == ref.dtype and cache.device == ref.device
        assert cache.shape[1:] == ref.shape[1:], (cache.shape, ref.shape)
    pairs = block_pairs.to(device=ref.device, dtype=torch.int64).contiguous()
    assert pairs.dim() == 2 and pairs.shape[1] == 2
    if pairs.shape[0] == 0:
        return
    src_ptrs = torch.tensor([c.data_ptr() for c in src], dtype=torch.int64, device=ref.device)
    dst_ptrs = torch.tensor([c.data_ptr() for c in dst], dtype=torch.int64, device=ref.device)
    block_numel = ref[0].numel()
    grid = (pairs.shape[0], len(src), triton.cdiv(block_numel, _COPY_CHUNK))
    _launch(kernels.copy_blocks_kernel, grid, src_ptrs, dst_ptrs, ref, pairs, block_numel, CHUNK=_COPY_CHUNK)


class TritonBackend:
    """The five ops as Triton kernels: on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""

    __slots__ = ()
    name = "triton"

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
        if kv_quant.is_scaled(
            k_cache.dtype
        ):  # int8 caches run the torch reference on this device (fp8: native)
            TorchBackend().reshape_and_cache(
                key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
            )
            return
        _check_cache(k_cache, v_cache)
        _check_rows(key, value)
        assert key.shape == value.shape and key.shape[1:] == k_cache.shape[2:], (key.shape, k_cache.shape)
        assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (key.shape[0],)
        if key.shape[0] == 0:
            return
        row = key.shape[1] * key.shape[2]
        _launch(
            kernels.reshape_and_cache_kernel,
            (key.shape[0],),
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            key.stride(0),
            value.stride(0),
            ROW=row,
            ROW_PAD=_pow2(row),
            BLOCK_SIZE=k_cache.shape[1],
            **_fp8_meta(k_cache.dtype),
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
        """Attention of one query per sequence (position context_lens[i] - 1), split-K over long contexts."""
        return decode_with_partitions(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            out=out,
            partition_size=DECODE_PARTITION_SIZE,
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
        """Varlen causal attention of each sequence's last q_len tokens over its paged K/V (cached and new)."""
        _check_cache(k_cache, v_cache)
        k_scale_arg, v_scale_arg = _scale_args(k_cache, v_cache, k_scale, v_scale)
        head_dim_pad, group, f32 = _attention_config(q, k_cache)
        out = _new_out(q, out)
        num_tokens, _, head_dim = q.shape
        num_seqs = context_lens.shape[0]
        assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
        assert context_lens.dtype == torch.int32 and context_lens.is_contiguous()
        assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,)
        assert query_start_loc.is_contiguous()
        if num_tokens == 0 or num_seqs == 0:
            return out
        block_m = _pow2(group, 64 if head_dim_pad > 128 else 128)
        block_q = block_m // group
        # Sequence s owns tiles query_start_loc[s] // block_q + s onwards, so this grid covers every sequence's
        # queries without reading lengths back to the host; surplus tiles exit without work.
        grid = (num_tokens // block_q + num_seqs, k_cache.shape[2])
        _launch(
            kernels.paged_prefill_kernel,
            grid,
            out,
            q,
            k_cache,
            v_cache,
            k_scale_arg,
            v_scale_arg,
            block_tables,
            query_start_loc,
            context_lens,
            scale,
            logit_softcap if logit_softcap is not None else 1.0,
            sliding_window if sliding_window is not None else 0,
            num_seqs,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            block_tables.stride(0),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            GROUP=group,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=32 if head_dim_pad > 128 else 64,
            BLOCK_SIZE=k_cache.shape[1],
            USE_WINDOW=sliding_window is not None,
            USE_SOFTCAP=logit_softcap is not None,
            F32=f32,
            INT8=k_scale is not None,
            num_warps=8 if head_dim_pad > 64 else 4,
        )
        return out

    def copy_blocks(
        self,
        k_caches: list[Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        v_caches: list[Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        block_pairs: Tensor,  # int64 [num_pairs, 2] (src, dst)
    ) -> None:
        """Copy block src to block dst in every layer's K and V cache, all layers in one kernel launch."""
        caches = [*k_caches, *v_caches]
        if caches:
            _launch_copy(caches, caches, block_pairs)

    def swap_blocks(
        self,
        src: Tensor,  # [num_blocks_src, block_size, num_kv_heads, head_dim]
        dst: Tensor,  # [num_blocks_dst, block_size, num_kv_heads, head_dim]
        block_pairs: Tensor,  # int64 [num_pairs, 2] (src block, dst block)
    ) -> None:
        """Copy blocks between caches: a kernel when both are on one device, async DMA copies host <-> device.

        Between host and device, Triton cannot take a host tensor, and per-block `copy_(non_blocking=True)` from
        pinned memory is a DMA on the copy engine that leaves the SMs to compute, so the torch path is the right one.
        """
        assert src.shape[1:] == dst.shape[1:] and src.dtype == dst.dtype, (src.shape, dst.shape)
        if src.device != dst.device:
            TorchBackend().swap_blocks(src, dst, block_pairs)
            return
        _launch_copy([src], [dst], block_pairs)
