"""Quantized KV caches: the storage dtypes of `--kv-cache-dtype` and the int8 write rules (the specification).

A cache is stored in the model's dtype ("auto"), in int8 with scales, or in fp8 (e4m3 or e5m2, vLLM's names;
unscaled, as vLLM's default scale of 1.0). An int8 cache scales its keys and its values differently (KIVI's
split: keys have outlier channels, values do not), and a value is always `q * scale`:

- keys: one scale per block, KV head and channel, `k_scale` bfloat16 `[num_blocks, num_kv_heads, head_dim]`;
- values: one scale per token slot and KV head, `v_scale` float32 `[num_blocks, block_size, num_kv_heads]`.

Key scales are bfloat16 because there are head_dim of them per block (float32 would take 0.57x bfloat16 KV's
bytes, bfloat16 0.54x); a scale's precision does not matter, only that values are divided by the very scale
stored, and that it is not below `amax / 127`: so a key scale is `amax / 127` rounded *up* to bfloat16
(`ceil_bfloat16`), and no value ever exceeds 127 steps.

Why: measured on the default model (Gemma 3 270M, one KV head of 256 channels; the pagedkernel README has the
table), one scale per block and head gave 1.027x bfloat16 KV's perplexity, one per token and head 1.014x, groups
of 32 channels 1.006x, and per-channel keys with per-token values 1.001x (this rule, with bfloat16 key
scales, measured in the real cache: 1.0005x): a few key channels are far larger
than the rest, so any scale shared across channels leaves the others a handful of int8 steps. Values alone,
per token, cost nothing measurable (0.998x), keys alone per token 1.017x.

The value rule: each written row (one token, one KV head) gets the scale `amax / 127` of its own absolute
maximum, and its values `round(x / scale)`; rows never change once written.

The key rule (requantize-on-growth, per channel): a write that starts a block (its first row lands on offset 0)
sets each channel's scale to the rows' absolute maximum in that channel / 127; a later write into the same block
whose rows exceed `127 * scale` in a channel raises that channel's scale to their maximum / 127 and requantizes
the channel's earlier rows (`round(q * old / new)`), so no value is ever clamped. Why not fix the scale at the
first write and clamp: the first token's keys say little about the rest, and clamping an outlier distorts the
scores that matter; a requantize costs at most one extra rounding (half a step of the new scale) on a block's
earlier rows, only while the block grows. Within one call, the rows of a block are quantized together.

Every scale is at least float32's smallest normal (an all-zero row or channel still divides); divisions are
float32 `x / scale`, rounded half to even. The C kernel computes the same (`csrc/cpu_attention.c`, bit for bit).
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
KEY_SCALE_DTYPE = torch.bfloat16
VALUE_SCALE_DTYPE = torch.float32


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
    """Whether a cache of this dtype carries scales (int8: per-channel key scales, per-token value scales)."""
    return dtype == torch.int8


def to_fp8(x: Tensor, dtype: torch.dtype) -> Tensor:  # same shape, in `dtype`
    """x rounded to an fp8 dtype, saturated to its finite range (e4m3fn has no infinity: it would become NaN)."""
    limit = torch.finfo(dtype).max
    return x.float().clamp(-limit, limit).to(dtype)


def as_bytes(cache: Tensor) -> Tensor:  # same shape; uint8 for an fp8 cache, else `cache` itself
    """An fp8 cache viewed as its bytes, for the indexed copies torch's CPU kernels lack for fp8."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def ceil_bfloat16(x: Tensor) -> Tensor:  # float32, same shape, each value a bfloat16 one
    """Positive finite float32 values rounded up to the next bfloat16 (the low 16 bits of the float cleared,
    carrying into the exponent), so that a scale never shrinks below what its values need."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & -0x10000).view(torch.float32)


def key_scale_shape(cache: Tensor) -> tuple[int, int, int]:
    """k_scale's shape for an int8 cache: (num_blocks, num_kv_heads, head_dim)."""
    return (cache.shape[0], cache.shape[2], cache.shape[3])


def value_scale_shape(cache: Tensor) -> tuple[int, int, int]:
    """v_scale's shape for an int8 cache: (num_blocks, block_size, num_kv_heads)."""
    return (cache.shape[0], cache.shape[1], cache.shape[2])


def write_int8_values(
    x: Tensor,  # [num_tokens, num_kv_heads, head_dim], any float dtype
    cache: Tensor,  # int8 [num_blocks, block_size, num_kv_heads, head_dim]
    scales: Tensor,  # float32 [num_blocks, block_size, num_kv_heads]
    slot_mapping: Tensor,  # int64 [num_tokens], no negative slots
) -> None:
    """Quantize each row into its slot with its own scale (its absolute maximum / 127), stored beside it."""
    if slot_mapping.numel() == 0:
        return
    q, scale = quantize_rows(x)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, q)
    scales.view(-1, scales.shape[2]).index_copy_(0, slot_mapping, scale)


def write_int8_keys(
    x: Tensor,  # [num_tokens, num_kv_heads, head_dim], any float dtype
    cache: Tensor,  # int8 [num_blocks, block_size, num_kv_heads, head_dim]
    scales: Tensor,  # bfloat16 [num_blocks, num_kv_heads, head_dim]
    slot_mapping: Tensor,  # int64 [num_tokens], no negative slots
) -> None:
    """Quantize rows into their slots, raising (and requantizing) each touched block's channel scales as needed."""
    if slot_mapping.numel() == 0:
        return
    block_size, num_heads, head_dim = cache.shape[1], cache.shape[2], cache.shape[3]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    touched, inverse = torch.unique(blocks, return_inverse=True)
    # Per touched block, head and channel: the new rows' absolute maximum; per block the first offset written.
    amax = torch.zeros(touched.shape[0], num_heads, head_dim, dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(
        0,
        inverse[:, None, None].expand(-1, num_heads, head_dim),
        x.float().abs(),
        reduce="amax",
        include_self=True,
    )
    first = torch.full((touched.shape[0],), block_size, dtype=torch.int64, device=x.device)
    first.scatter_reduce_(0, inverse, offsets, reduce="amin", include_self=True)
    fresh = ceil_bfloat16((amax / INT8_MAX).clamp(min=_MIN_SCALE))
    old = scales[touched].float()  # [touched, num_heads, head_dim]
    starts = first[:, None, None] > 0
    grows = starts & (fresh > old)
    new = torch.where(starts, torch.maximum(old, fresh), fresh)
    if bool(grows.any()):
        # Rows below `first` were written before: requantize their grown channels to the raised scale.
        ratio = torch.where(grows, old / new, torch.ones_like(new))  # [touched, num_heads, head_dim]
        earlier = torch.arange(block_size, device=x.device)[None, :] < first[:, None]  # [touched, block_size]
        rows = cache[touched].float()  # [touched, block_size, num_heads, head_dim]
        requantized = torch.round(rows * ratio[:, None]).clamp_(-INT8_MAX, INT8_MAX)
        keep = ~(earlier[:, :, None, None] & grows[:, None])
        cache[touched] = torch.where(keep, rows, requantized).to(torch.int8)
    scales[touched] = new.to(scales.dtype)  # exact: every value is a bfloat16 one
    q = torch.round(x.float() / new[inverse]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, q)


def quantize_rows(
    x: Tensor,  # [num_tokens, num_kv_heads, head_dim], any float dtype
) -> tuple[Tensor, Tensor]:  # int8 [num_tokens, num_kv_heads, head_dim], float32 [num_tokens, num_kv_heads]
    """Each row's int8 values and scale: scale = max(|x|) / 127 (at least float32's tiny), q = round(x / scale)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / INT8_MAX).clamp_(min=_MIN_SCALE)
    q = torch.round(xf / scale[:, :, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_keys(
    rows: Tensor,  # int8 [n, block_size, num_kv_heads, head_dim], whole gathered blocks
    scales: Tensor,  # bfloat16 [n, num_kv_heads, head_dim], the same blocks' channel scales
    dtype: torch.dtype,
) -> Tensor:  # [n, block_size, num_kv_heads, head_dim] in `dtype`
    """The keys `q * scale` of gathered int8 blocks, computed in float32."""
    return (rows.float() * scales.float()[:, None]).to(dtype)


def dequantize_values(
    rows: Tensor,  # int8 [n, block_size, num_kv_heads, head_dim], whole gathered blocks
    scales: Tensor,  # float32 [n, block_size, num_kv_heads], the same blocks' row scales
    dtype: torch.dtype,
) -> Tensor:  # [n, block_size, num_kv_heads, head_dim] in `dtype`
    """The values `q * scale` of gathered int8 blocks, computed in float32."""
    return (rows.float() * scales[..., None]).to(dtype)
