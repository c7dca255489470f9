"""Quantized KV caches: the storage dtypes of `--kv-cache-dtype` and the int8 write rule (the specification).

A cache is stored in the model's dtype ("auto"), in int8 with one float32 scale per token and KV head, or in fp8
(e4m3 or e5m2, vLLM's names; unscaled, as vLLM's default scale of 1.0). An int8 cache's scales are a float32
tensor `[num_blocks, block_size, num_kv_heads]` beside it (`k_scale`, `v_scale` of the ops), one per cache slot
and head; a value is `q * scale`.

The write rule: each written row (one token, one KV head, `head_dim` channels) gets the scale `amax / 127` of its
own absolute maximum (at least float32's smallest normal, so an all-zero row still divides), and its values
`round(x / scale)` (round half to even, float32 division), which never clamp. Why per token rather than per block:
measured on the default model (Gemma 3 270M, one KV head of 256 channels), one scale per block and head gave
1.027x bfloat16 KV's perplexity, one per token and head 1.00x (the pagedkernel README's table has every candidate
measured); it costs 4 bytes per 256 channels (0.51x bfloat16's bytes instead of 0.50x), and a row's bytes never
change once written: no requantization, so the result does not depend on how tokens are split into calls, and a
block's rows and scales move together as plain copies. The C kernel computes the same
(`csrc/cpu_attention.c`, bit for bit).
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
    """Whether a cache of this dtype carries per-token, per-head scales (int8)."""
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
    scales: Tensor,  # float32 [num_blocks, block_size, num_kv_heads]
    slot_mapping: Tensor,  # int64 [num_tokens], no negative slots
) -> None:
    """Quantize each row into its slot with its own scale (its absolute maximum / 127), stored beside it."""
    if slot_mapping.numel() == 0:
        return
    q, scale = quantize_rows(x)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, q)
    scales.view(-1, scales.shape[2]).index_copy_(0, slot_mapping, scale)


def quantize_rows(
    x: Tensor,  # [num_tokens, num_kv_heads, head_dim], any float dtype
) -> tuple[Tensor, Tensor]:  # int8 [num_tokens, num_kv_heads, head_dim], float32 [num_tokens, num_kv_heads]
    """Each row's int8 values and scale: scale = max(|x|) / 127 (at least float32's tiny), q = round(x / scale)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / INT8_MAX).clamp_(min=_MIN_SCALE)
    q = torch.round(xf / scale[:, :, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_rows(
    rows: Tensor,  # int8 [n, block_size, num_kv_heads, head_dim], whole gathered blocks
    scales: Tensor,  # float32 [n, block_size, num_kv_heads], the scales of the same blocks
    dtype: torch.dtype,
) -> Tensor:  # [n, block_size, num_kv_heads, head_dim] in `dtype`
    """The values `q * scale` of gathered int8 blocks, computed in float32."""
    return (rows.float() * scales[..., None]).to(dtype)
