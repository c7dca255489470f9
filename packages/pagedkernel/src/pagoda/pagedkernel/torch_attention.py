"""Dense attention over a padded batch gathered from the paged cache: the core of the torch backend.

Each sequence's visible keys are gathered block by block into [num_seqs, num_kv_heads, n_keys, head_dim] (see
`visible_keys`: rows past a sequence's end are zeroed, so that slots never written, which may hold NaN bits, never
reach the output). Attention then runs through `scaled_dot_product_attention`, whose CPU flash kernel skips the
masked upper triangle when `is_causal` is set and never materialises the scores; only a logit softcap, which SDPA
cannot express, takes the explicit matmul path (in float32). A bfloat16 cache is attended in bfloat16 (the flash
kernels accumulate in float32): on CPUs with AMX, and on GPUs, that is 4x faster than upcasting and skips the
float32 copy of every gathered key; float16 and float32 caches are attended in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagoda.pagedkernel import kv_quant
from torch import Tensor

# The matmul (softcap) path processes query rows in chunks so its float32 scores stay under this many elements.
_MAX_SCORE_ELEMENTS = 1 << 25


def compute_dtype(cache_dtype: torch.dtype, logit_softcap: float | None) -> torch.dtype:
    """The dtype attention runs in: bfloat16 for a bfloat16 cache without softcap, else float32."""
    return torch.bfloat16 if cache_dtype == torch.bfloat16 and logit_softcap is None else torch.float32


@dataclass(frozen=True, slots=True)
class VisibleKeys:
    """Which cache blocks to gather for a padded batch, the key position of every gathered row, and the rows to
    blank (positions past a sequence's end: slots never written, which may hold NaN bits)."""

    blocks: Tensor  # int64 [num_seqs, n_blocks], cache block ids in key order
    key_pos: Tensor  # int64 [num_seqs, n_blocks * block_size], position of each gathered key
    blank_rows: Tensor  # int64 [num_blank], flat rows (seq * n_keys + key) to zero after the gather


def visible_keys(
    block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    first_pos: Tensor,  # int64 [num_seqs], first key position any query of the sequence can see
    context_lens: Tensor,  # int64 [num_seqs]
    block_size: int,
) -> VisibleKeys:
    """The whole blocks holding keys first_pos .. context_len - 1 of each sequence (padded to the longest).

    Whole blocks rather than single slots: index_select copies a block (block_size rows) with one memcpy, 3x
    faster than a slot at a time. Keys before first_pos in the first block are real and get masked; padding
    blocks repeat the sequence's first visible block, and every row past a sequence's end is blanked, because
    masking alone does not stop NaN: the attention weight 0 times a NaN value is NaN.
    """
    first_block = torch.div(first_pos, block_size, rounding_mode="floor")
    end_block = torch.div(context_lens + block_size - 1, block_size, rounding_mode="floor")
    n_blocks = int((end_block - first_block).max().item())
    index = first_block[:, None] + torch.arange(n_blocks, device=first_pos.device)[None, :]
    index = torch.where(index < end_block[:, None], index, first_block[:, None])
    blocks = block_tables.long().gather(1, index)
    offsets = torch.arange(n_blocks * block_size, device=first_pos.device)
    key_pos = first_block[:, None] * block_size + offsets[None, :]
    blank = (key_pos >= context_lens[:, None]).flatten().nonzero().flatten()
    return VisibleKeys(blocks, key_pos, blank)


def gather_kv(
    cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    keys: VisibleKeys,
    dtype: torch.dtype,
    scales: Tensor
    | None = None,  # float32 of an int8 cache: k_scale [num_blocks, kvh, d] or v_scale [num_blocks, bs, kvh]
    dequantize: Callable[[Tensor, Tensor, torch.dtype], Tensor] = kv_quant.dequantize_values,
) -> Tensor:  # [num_seqs, num_kv_heads, n_keys, head_dim] in `dtype` (a strided view of one gathered copy)
    """The cache blocks of `keys`, blank rows zeroed, heads first, in `dtype` (int8 and fp8 caches dequantized)."""
    num_seqs, n_keys = keys.key_pos.shape
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    flat = keys.blocks.flatten()
    rows = kv_quant.as_bytes(cache).view(cache.shape[0], -1).index_select(0, flat).view(cache.dtype)
    if scales is not None:
        rows = dequantize(rows.view(-1, *cache.shape[1:]), scales.index_select(0, flat), dtype)
    elif rows.dtype in kv_quant.FP8_DTYPES:
        rows = rows.to(dtype)  # fp8 first: the blanking below fills in the compute dtype
    rows = rows.view(num_seqs * n_keys, num_kv_heads * head_dim).index_fill_(0, keys.blank_rows, 0.0)
    heads_first = rows.view(num_seqs, n_keys, num_kv_heads, head_dim).transpose(1, 2)
    return heads_first.to(dtype)


def attend(
    q: Tensor,  # [num_seqs, q_len, num_heads, head_dim]
    k: Tensor,  # [num_seqs, num_kv_heads, n_keys, head_dim], in the compute dtype
    v: Tensor,  # [num_seqs, num_kv_heads, n_keys, head_dim], in the compute dtype
    q_pos: Tensor,  # int64 [num_seqs, q_len]
    key_pos: Tensor,  # int64 [num_seqs, n_keys]
    scale: float,
    *,
    sliding_window: int | None,
    logit_softcap: float | None,
    causal: bool,
) -> Tensor:  # [num_seqs, q_len, num_heads, head_dim] in k's dtype
    """Attention of q at q_pos over keys at key_pos; `causal` says query r sits at key position r (no mask needed)."""
    num_seqs, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    q = q.to(k.dtype)
    if logit_softcap is not None:
        return _attend_softcap(q, k, v, q_pos, key_pos, scale, sliding_window, logit_softcap)
    # [num_seqs, 1, q_len, n_keys], broadcast over heads
    mask = None if causal else _visible(q_pos, key_pos, sliding_window)[:, None]
    if q_len == 1:
        # Decode: the group's query heads are the rows of one KV head, so K/V are used as they are.
        rows = q.view(num_seqs, num_kv_heads, group, head_dim)
        if k.dtype == torch.bfloat16:
            out = _decode_matmul(rows, k, v, mask, scale)
        else:
            out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scale)
        return out.view(num_seqs, 1, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k,
        v,
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=group > 1,
    )
    return out.transpose(1, 2)


def _decode_matmul(
    q: Tensor,  # bfloat16 [num_seqs, num_kv_heads, group, head_dim]
    k: Tensor,  # bfloat16 [num_seqs, num_kv_heads, n_keys, head_dim]
    v: Tensor,  # bfloat16 [num_seqs, num_kv_heads, n_keys, head_dim]
    mask: Tensor | None,  # bool [num_seqs, 1, 1, n_keys], True = visible
    scale: float,
) -> Tensor:  # bfloat16 [num_seqs, num_kv_heads, group, head_dim]
    """One-query attention as two bfloat16 matmuls around a float32 softmax (Hugging Face's eager order).

    For a single query row SDPA's flash kernel mostly pays its tiling overhead: on AMX CPUs the two batched
    matmuls measured 20-33% faster at 32-128 sequences of 176-700 keys. The scores are few (rows x keys), so the
    float32 softmax costs little.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)  # [num_seqs, kv_heads, group, n_keys]
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)


def _visible(
    q_pos: Tensor,  # int64 [num_seqs, q_len]
    key_pos: Tensor,  # int64 [num_seqs, n_keys]
    sliding_window: int | None,
) -> Tensor:  # bool [num_seqs, q_len, n_keys]
    """Key j is visible to the query at i iff j <= i and i - j < sliding_window."""
    visible = key_pos[:, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        visible &= q_pos[:, :, None] - key_pos[:, None, :] < sliding_window
    return visible


def _attend_softcap(
    q: Tensor,  # float32 [num_seqs, q_len, num_heads, head_dim]
    k: Tensor,  # float32 [num_seqs, num_kv_heads, n_keys, head_dim]
    v: Tensor,  # float32 [num_seqs, num_kv_heads, n_keys, head_dim]
    q_pos: Tensor,  # int64 [num_seqs, q_len]
    key_pos: Tensor,  # int64 [num_seqs, n_keys]
    scale: float,
    sliding_window: int | None,
    logit_softcap: float,
) -> Tensor:  # float32 [num_seqs, q_len, num_heads, head_dim]
    """Explicit scores (softcap between scaling and masking), GQA by folding a group's heads into rows."""
    num_seqs, q_len, num_heads, head_dim = q.shape
    num_kv_heads, n_keys = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    # [num_seqs, num_kv_heads, group, q_len, head_dim]: one K/V head serves its whole group without copies.
    rows = q.view(num_seqs, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    out = torch.empty_like(rows)
    chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, num_seqs * num_heads * n_keys))
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        n = stop - start
        qc = rows[:, :, :, start:stop].reshape(num_seqs, num_kv_heads, group * n, head_dim)
        scores = torch.matmul(qc, k.transpose(-1, -2)).mul_(scale)
        scores.div_(logit_softcap).tanh_().mul_(logit_softcap)
        visible = _visible(q_pos[:, start:stop], key_pos, sliding_window)
        scores = scores.view(num_seqs, num_kv_heads, group, n, n_keys).masked_fill_(
            ~visible[:, None, None], float("-inf")
        )
        probs = torch.softmax(scores, dim=-1).view(num_seqs, num_kv_heads, group * n, n_keys)
        out[:, :, :, start:stop] = torch.matmul(probs, v).view(num_seqs, num_kv_heads, group, n, head_dim)
    return out.permute(0, 3, 1, 2, 4).reshape(num_seqs, q_len, num_heads, head_dim)
