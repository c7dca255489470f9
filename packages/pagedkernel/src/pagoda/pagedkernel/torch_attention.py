"""Dense attention over a padded batch gathered from the paged cache: the core of the torch backend.

Each sequence's visible keys are gathered slot by slot into [num_seqs, num_kv_heads, n_keys, head_dim] (positions
past a sequence's end read its first visible slot instead, so that slots never written, which may hold NaN
bits, are never read). Attention then runs through `scaled_dot_product_attention`, whose CPU flash kernel skips the
masked upper triangle when `is_causal` is set and never materialises the scores; only a logit softcap, which SDPA
cannot express, takes the explicit matmul path (in float32). A bfloat16 cache is attended in bfloat16 (the flash
kernels accumulate in float32): on CPUs with AMX, and on GPUs, that is 4x faster than upcasting and skips the
float32 copy of every gathered key; float16 and float32 caches are attended in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# The matmul (softcap) path processes query rows in chunks so its float32 scores stay under this many elements.
_MAX_SCORE_ELEMENTS = 1 << 25


def visible_slots(
    block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    first_pos: Tensor,  # int64 [num_seqs], first key position any query of the sequence can see
    context_lens: Tensor,  # int64 [num_seqs]
    block_size: int,
) -> tuple[Tensor, Tensor]:  # int64 [num_seqs, n_keys] cache slots, int64 [num_seqs, n_keys] key positions
    """Cache slot and position of keys first_pos, first_pos + 1, ... of each sequence (padded to the longest)."""
    n_keys = int((context_lens - first_pos).max().item())
    key_pos = first_pos[:, None] + torch.arange(n_keys, device=first_pos.device)[None, :]
    # Positions past the end read the first visible slot: a written key, masked out later. This also keeps
    # table entries past a sequence's last block (which may hold anything) from ever being read.
    safe_pos = torch.where(key_pos < context_lens[:, None], key_pos, first_pos[:, None])
    blocks = block_tables.long().gather(1, torch.div(safe_pos, block_size, rounding_mode="floor"))
    return blocks * block_size + safe_pos % block_size, key_pos


def compute_dtype(cache_dtype: torch.dtype, logit_softcap: float | None) -> torch.dtype:
    """The dtype attention runs in: bfloat16 for a bfloat16 cache without softcap, else float32."""
    return torch.bfloat16 if cache_dtype == torch.bfloat16 and logit_softcap is None else torch.float32


def gather_kv(
    cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slots: Tensor,  # int64 [num_seqs, n_keys]
    dtype: torch.dtype,
) -> Tensor:  # [num_seqs, num_kv_heads, n_keys, head_dim] in `dtype` (a strided view of one gathered copy)
    """The cache rows at `slots`, heads first, in `dtype`."""
    num_seqs, n_keys = slots.shape
    # index_select on 2-D rows copies each row with one memcpy: 3-6x faster on CPU than advanced indexing.
    rows = cache.view(-1, cache.shape[2] * cache.shape[3]).index_select(0, slots.flatten())
    heads_first = rows.view(num_seqs, n_keys, cache.shape[2], cache.shape[3]).transpose(1, 2)
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
    mask = None if causal else _visible(q_pos, key_pos, sliding_window)  # [num_seqs, q_len, n_keys]
    if q_len == 1:
        # Decode: the group's query heads are the rows of one KV head, so K/V are used as they are.
        out = F.scaled_dot_product_attention(
            q.view(num_seqs, num_kv_heads, group, head_dim),
            k,
            v,
            attn_mask=None if mask is None else mask[:, None],
            scale=scale,
        )
        return out.view(num_seqs, 1, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k,
        v,
        attn_mask=None if mask is None else mask[:, None],
        is_causal=causal,
        scale=scale,
        enable_gqa=group > 1,
    )
    return out.transpose(1, 2)


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
