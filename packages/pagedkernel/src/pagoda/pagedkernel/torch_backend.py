"""The torch backend: the specification of every op, and the engine's CPU path.

Attention gathers each sequence's K/V blocks through its block table into a padded batch and runs batched
matmuls in float32 (no loop over tokens). Sequences with a single query (decodes) share one batched call;
sequences with many queries (prefill chunks) are padded together when their lengths are close, else run one by
one, so that a long prompt does not pad every decode in the same step to its length.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Above this many float32 score elements per chunk, the query rows are processed in chunks to bound memory.
_MAX_SCORE_ELEMENTS = 1 << 25


def reshape_and_cache(
    key: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: Tensor,  # int64 [num_tokens], negative = padding
) -> None:
    """Write each token's key and value into cache slot `slot_mapping[t]`, skipping negative slots."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    # view() (not reshape) so that a non-contiguous cache fails loudly instead of writing into a copy.
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[valid].to(v_cache.dtype)


def _gather_kv(
    cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: Tensor,  # int64 [num_seqs, n_blocks]
) -> Tensor:  # float32 [num_seqs, num_kv_heads, n_blocks * block_size, head_dim]
    """K or V of the given blocks per sequence, heads first, in float32 (one gather, one converting copy)."""
    gathered = cache[block_ids].flatten(1, 2)  # [num_seqs, n_tokens, num_kv_heads, head_dim]
    out = torch.empty(
        (gathered.shape[0], gathered.shape[2], gathered.shape[1], gathered.shape[3]),
        dtype=torch.float32,
        device=cache.device,
    )
    out.copy_(gathered.transpose(1, 2))
    return out


def _visible_blocks(
    block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    first_pos: Tensor,  # int64 [num_seqs], first key position any query of the sequence can see
    context_lens: Tensor,  # int64 [num_seqs]
    block_size: int,
) -> tuple[Tensor, Tensor]:  # int64 [num_seqs, n_blocks] block ids, int64 [num_seqs, n_tokens] key positions
    """The blocks holding keys [first_pos, context_len) of each sequence, and each gathered key's position."""
    first_block = torch.div(first_pos, block_size, rounding_mode="floor")
    end_block = torch.div(context_lens + block_size - 1, block_size, rounding_mode="floor")
    n_blocks = int((end_block - first_block).max().item()) if len(context_lens) else 0
    index = first_block[:, None] + torch.arange(n_blocks, device=block_tables.device)[None, :]
    in_range = index < end_block[:, None]
    # Entries past a sequence's last block may hold any value: read block 0 there instead, masked out below.
    safe_index = torch.where(in_range, index, 0).clamp_(max=max(block_tables.shape[1] - 1, 0))
    block_ids = torch.where(in_range, block_tables.long().gather(1, safe_index), 0)
    offsets = torch.arange(block_size, device=block_tables.device)
    key_pos = (index[:, :, None] * block_size + offsets).flatten(1)
    return block_ids, key_pos


def _attend_padded(
    q: Tensor,  # [num_seqs, q_len, num_heads, head_dim]
    k: Tensor,  # float32 [num_seqs, num_kv_heads, n_keys, head_dim]
    v: Tensor,  # float32 [num_seqs, num_kv_heads, n_keys, head_dim]
    q_pos: Tensor,  # int64 [num_seqs, q_len]
    key_pos: Tensor,  # int64 [num_seqs, n_keys]
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> Tensor:  # float32 [num_seqs, q_len, num_heads, head_dim]
    """Masked attention over a padded batch, GQA by folding the query heads of a group into rows."""
    num_seqs, q_len, num_heads, head_dim = q.shape
    num_kv_heads, n_keys = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    # Rows are (head in group, query) pairs so that one K/V head serves its whole group without copies.
    rows = (
        q.view(num_seqs, q_len, num_kv_heads, group, head_dim)
        .permute(0, 2, 3, 1, 4)
        .to(torch.float32)
        .reshape(num_seqs, num_kv_heads, group * q_len, head_dim)
    )
    out = torch.empty_like(rows)
    chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, num_seqs * num_heads * n_keys))
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        n = stop - start
        qc = rows.view(num_seqs, num_kv_heads, group, q_len, head_dim)[:, :, :, start:stop]
        scores = torch.matmul(qc.reshape(num_seqs, num_kv_heads, group * n, head_dim), k.transpose(-1, -2))
        scores.mul_(scale)
        if logit_softcap is not None:
            scores.div_(logit_softcap).tanh_().mul_(logit_softcap)
        qp = q_pos[:, start:stop, None]  # [num_seqs, n, 1]
        visible = key_pos[:, None, :] <= qp  # [num_seqs, n, n_keys]
        if sliding_window is not None:
            visible &= qp - key_pos[:, None, :] < sliding_window
        scores = scores.view(num_seqs, num_kv_heads, group, n, n_keys)
        scores.masked_fill_(~visible[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(num_seqs, num_kv_heads, group * n, n_keys)
        out.view(num_seqs, num_kv_heads, group, q_len, head_dim)[:, :, :, start:stop] = torch.matmul(
            probs, v
        ).view(num_seqs, num_kv_heads, group, n, head_dim)
    return (
        out.view(num_seqs, num_kv_heads, group, q_len, head_dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(num_seqs, q_len, num_heads, head_dim)
    )


def _attend_group(
    q: Tensor,  # [num_seqs, q_len, num_heads, head_dim], padded
    q_lens: Tensor,  # int64 [num_seqs]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    context_lens: Tensor,  # int64 [num_seqs]
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> Tensor:  # float32 [num_seqs, q_len, num_heads, head_dim]
    """Attention for a padded batch of sequences whose queries are their last q_lens tokens."""
    q_len = q.shape[1]
    # Query r of sequence s sits at position context_len - q_len_s + r; padding rows get clamped positions.
    q_pos = context_lens[:, None] - q_lens[:, None] + torch.arange(q_len, device=q.device)[None, :]
    q_pos = torch.minimum(q_pos, context_lens[:, None] - 1)
    first_pos = (context_lens - q_lens).clamp(min=0)
    if sliding_window is not None:
        first_pos = (first_pos - sliding_window + 1).clamp(min=0)
    else:
        first_pos = torch.zeros_like(first_pos)
    block_ids, key_pos = _visible_blocks(block_tables, first_pos, context_lens, k_cache.shape[1])
    k = _gather_kv(k_cache, block_ids)
    v = _gather_kv(v_cache, block_ids)
    return _attend_padded(q, k, v, q_pos, key_pos, scale, sliding_window, logit_softcap)


def _check_attention_args(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """Shapes that every attention op relies on."""
    assert q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (q.shape, k_cache.shape)
    assert q.shape[-1] == k_cache.shape[-1], "head_dim of q and the cache differ"
    assert q.shape[1] % k_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads"


def paged_decode_attention(
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
) -> Tensor:
    """Attention of one query per sequence, at position context_lens[i] - 1, over its paged K/V."""
    _check_attention_args(q, k_cache, v_cache)
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    lens = context_lens.long()
    result = _attend_group(
        q[:, None],
        torch.ones_like(lens),
        k_cache,
        v_cache,
        block_tables,
        lens,
        scale,
        sliding_window,
        logit_softcap,
    )
    out.copy_(result[:, 0])
    return out


def paged_prefill_attention(
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
) -> Tensor:
    """Causal attention of each sequence's last q_len tokens (rows query_start_loc[i]:[i+1]) over all its tokens."""
    _check_attention_args(q, k_cache, v_cache)
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    lens = context_lens.long()
    for seqs in _batches(q_lens):
        seq_ids = torch.as_tensor(seqs, device=q.device, dtype=torch.long)
        group_lens = q_lens[seq_ids]
        width = int(group_lens.max().item())
        # Token index of (sequence, row); rows past a sequence's q_len are padding and read its last token.
        rows = torch.arange(width, device=q.device)[None, :]
        token = starts[seq_ids, None] + torch.minimum(rows, group_lens[:, None] - 1)
        result = _attend_group(
            q[token],
            group_lens,
            k_cache,
            v_cache,
            block_tables[seq_ids],
            lens[seq_ids],
            scale,
            sliding_window,
            logit_softcap,
        )
        real = rows < group_lens[:, None]
        out[token[real]] = result[real].to(out.dtype)
    return out


def _batches(q_lens: Tensor) -> list[list[int]]:
    """Sequences grouped for padded batching: all decodes together, longer chunks by similar length."""
    lens = q_lens.tolist()
    order = sorted((n, i) for i, n in enumerate(lens) if n > 0)
    groups: list[list[int]] = []
    group_max = 0
    group_tokens = 0
    for n, i in order:
        # Start a new group when padding the current one to n would waste more than a quarter of its work.
        if groups and (group_max == n or (len(groups[-1]) + 1) * n <= 1.25 * (group_tokens + n)):
            groups[-1].append(i)
            group_tokens += n
        else:
            groups.append([i])
            group_tokens = n
        group_max = n
    return groups


def copy_blocks(
    k_caches: list[Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    block_pairs: Tensor,  # int64 [num_pairs, 2] (src, dst)
) -> None:
    """Copy block src to block dst in every layer's K and V cache (dst blocks must not also be sources)."""
    if block_pairs.numel() == 0:
        return
    for cache in [*k_caches, *v_caches]:
        pairs = block_pairs.to(cache.device)
        cache[pairs[:, 1]] = cache[pairs[:, 0]]


def swap_blocks(
    src: Tensor,  # [num_blocks_src, block_size, num_kv_heads, head_dim]
    dst: Tensor,  # [num_blocks_dst, block_size, num_kv_heads, head_dim]
    block_pairs: Tensor,  # int64 [num_pairs, 2] (src block, dst block)
) -> None:
    """Copy blocks between two caches; across devices each block is one async copy (pinned host memory)."""
    if block_pairs.numel() == 0:
        return
    assert src.shape[1:] == dst.shape[1:] and src.dtype == dst.dtype, (src.shape, dst.shape)
    if src.device == dst.device:
        pairs = block_pairs.to(src.device)
        dst[pairs[:, 1]] = src[pairs[:, 0]]
        return
    # One copy_ per block: blocks are contiguous, so each is a single DMA that overlaps with compute when the
    # host side is pinned; a gather on the host would need an unpinned temporary and a synchronous copy.
    for s, d in block_pairs.tolist():
        dst[d].copy_(src[s], non_blocking=True)
