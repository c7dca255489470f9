"""Quantized KV caches: the storage dtypes of `--kv-cache-dtype` and the int8 write rule (the specification).

A cache is stored in the model's dtype ("auto"), in int8 with one float32 scale per block and KV head, or in fp8
(e4m3 or e5m2, vLLM's names; unscaled, as vLLM's default scale of 1.0). An int8 cache's scales are a float32
tensor `[num_blocks, num_kv_heads]` beside it (`k_scale`, `v_scale` of the ops); a value is `q * scale`.

How an int8 block's scale follows the block as it fills (requantize-on-growth): a write that starts a block
(its first row lands on offset 0) sets the scale to the rows' absolute maximum / 127; a later write into the same
block whose rows exceed `127 * scale` raises the scale to their maximum / 127 and requantizes the rows already
there (`round(q * old / new)`), so no value is ever clamped. Why not fix the scale at the first write and clamp:
the first token's keys say little about the rest (an attention sink's key is an outlier one way, a later token's
the other), and clamping an outlier distorts exactly the scores that matter; a requantize costs at most one extra
rounding (half a step of the new scale) on a block's earlier rows, and it happens only while a block grows.
Within one call, the rows of a block are quantized together (the block's new scale covers them all), so the
result does not depend on how the tokens are split into calls beyond those extra roundings. The C kernel
computes the same (`csrc/cpu_attention.c`, bit for bit: float32 `x / scale`, round half to even).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

KVCacheDtypeName = Literal["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_CACHE_DTYPE_NAMES: tuple[str, ...] = get_args(KVCacheDtypeName)
INT8_MAX = 127.0
# The smallest scale: an all-zero block still divides by a positive number (and requantizes to 0 later).
_MIN_SCALE = torch.finfo(torch.float32).tiny
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a cache of `--kv-cache-dtype name` is stored in ("auto": the model's; "fp8" is e4m3)."""
    if name == "auto":
        return model_dtype
    if name == "int8":
        return torch.int8
    if name in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if name == "fp8_e5m2":
        return torch.float8_e5m2
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, got {name!r}")


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype carries per-block, per-head scales (int8)."""
    return dtype == torch.int8


def to_fp8(x: Tensor, dtype: torch.dtype) -> Tensor:  # same shape, in `dtype`
    """x rounded to an fp8 dtype, saturated to its finite range (e4m3fn has no infinity: it would become NaN)."""
    limit = torch.finfo(dtype).max
    return x.float().clamp(-limit, limit).to(dtype)


def as_bytes(cache: Tensor) -> Tensor:  # same shape; uint8 for an fp8 cache, else `cache` itself
    """An fp8 cache viewed as its bytes, for the indexed copies torch's CPU kernels lack for fp8."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def write_int8(
    x: Tensor,  # [num_tokens, num_kv_heads, head_dim], any float dtype
    cache: Tensor,  # int8 [num_blocks, block_size, num_kv_heads, head_dim]
    scales: Tensor,  # float32 [num_blocks, num_kv_heads]
    slot_mapping: Tensor,  # int64 [num_tokens], no negative slots
) -> None:
    """Quantize rows into their slots, raising (and requantizing) each touched block's scale as needed."""
    if slot_mapping.numel() == 0:
        return
    block_size = cache.shape[1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    touched, inverse = torch.unique(blocks, return_inverse=True)
    num_heads = cache.shape[2]
    # Per touched block and head: the new rows' absolute maximum, and the first offset they write.
    amax = torch.zeros(touched.shape[0], num_heads, dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(
        0,
        inverse[:, None].expand(-1, num_heads),
        x.float().abs().amax(dim=-1),
        reduce="amax",
        include_self=True,
    )
    first = torch.full((touched.shape[0],), block_size, dtype=torch.int64, device=x.device)
    first.scatter_reduce_(0, inverse, offsets, reduce="amin", include_self=True)
    fresh = (amax / INT8_MAX).clamp(min=_MIN_SCALE)
    old = scales[touched]  # [touched, num_heads]
    grows = (first[:, None] > 0) & (fresh > old)
    new = torch.where(first[:, None] > 0, torch.maximum(old, fresh), fresh)
    if bool(grows.any()):
        # Rows below `first` were written before: requantize them to the raised scale.
        ratio = torch.where(grows, old / new, torch.ones_like(new))  # [touched, num_heads]
        earlier = torch.arange(block_size, device=x.device)[None, :] < first[:, None]  # [touched, block_size]
        rows = cache[touched].float()  # [touched, block_size, num_heads, head_dim]
        requantized = torch.round(rows * ratio[:, None, :, None]).clamp_(-INT8_MAX, INT8_MAX)
        keep = ~(earlier[:, :, None, None] & grows[:, None, :, None])
        cache[touched] = torch.where(keep, rows, requantized).to(torch.int8)
    scales[touched] = new
    q = torch.round(x.float() / new[inverse][:, :, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, q)


def dequantize_rows(
    rows: Tensor,  # int8 [n, block_size, num_kv_heads, head_dim], whole gathered blocks
    scales: Tensor,  # float32 [n, num_kv_heads], the scales of the same blocks
    dtype: torch.dtype,
) -> Tensor:  # [n, block_size, num_kv_heads, head_dim] in `dtype`
    """The values `q * scale` of gathered int8 blocks, computed in float32."""
    return (rows.float() * scales[:, None, :, None]).to(dtype)
