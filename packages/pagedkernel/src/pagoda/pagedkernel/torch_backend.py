"""The torch backend (`TorchBackend`): the specification of every op, and the fallback of the other backends.

Attention gathers each sequence's K/V through its block table into a padded batch and runs it (in float32, or in
bfloat16 for a bfloat16 cache) with
`scaled_dot_product_attention` (see `torch_attention`; no loop over tokens). Sequences are padded together in groups
(`plan_groups`): similar query lengths, and small enough that the gathered K/V stay in the CPU cache.
"""

from __future__ import annotations

import torch
from pagoda.pagedkernel import kv_quant, torch_attention
from torch import Tensor


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
    dtype: torch.dtype,  # the compute dtype (torch_attention.compute_dtype)
    k_scale: Tensor | None = None,  # bfloat16 [num_blocks, num_kv_heads, head_dim] of an int8 cache
    v_scale: Tensor | None = None,  # float32 [num_blocks, block_size, num_kv_heads] of an int8 cache
) -> Tensor:  # [num_seqs, q_len, num_heads, head_dim] in `dtype`
    """Attention for a padded batch of sequences whose queries are their last q_lens tokens."""
    q_len = q.shape[1]
    if sliding_window is not None and int(context_lens.max().item()) <= sliding_window:
        sliding_window = None  # no query is far enough from any key for the window to hide it
    # Query r of sequence s sits at position context_len - q_len_s + r; padding rows repeat the last position.
    q_pos = context_lens[:, None] - q_lens[:, None] + torch.arange(q_len, device=q.device)[None, :]
    q_pos = torch.minimum(q_pos, context_lens[:, None] - 1)
    if sliding_window is None:
        first_pos = torch.zeros_like(context_lens)
    else:
        first_pos = (context_lens - q_lens - sliding_window + 1).clamp(min=0)
    # Whole prompts without a window: query r sees keys 0..r, the layout SDPA's is_causal computes fastest.
    causal = q_len > 1 and sliding_window is None and bool((q_lens == context_lens).all().item())
    keys = torch_attention.visible_keys(block_tables, first_pos, context_lens, k_cache.shape[1])
    return torch_attention.attend(
        q,
        torch_attention.gather_kv(k_cache, keys, dtype, k_scale, kv_quant.dequantize_keys),
        torch_attention.gather_kv(v_cache, keys, dtype, v_scale, kv_quant.dequantize_values),
        q_pos,
        keys.key_pos,
        scale,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        causal=causal,
    )


def check_attention_args(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Shapes that every attention op relies on; an int8 cache comes with both scales, a float one with none."""
    assert q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (q.shape, k_cache.shape)
    assert q.shape[-1] == k_cache.shape[-1], "head_dim of q and the cache differ"
    assert q.shape[1] % k_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads"
    check_scales(k_cache, v_cache, k_scale, v_scale)


def check_scales(k_cache: Tensor, v_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> None:
    """An int8 cache has bfloat16 k_scale [num_blocks, num_kv_heads, head_dim] and float32 v_scale
    [num_blocks, block_size, num_kv_heads]; other caches have none."""
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    if not kv_quant.is_scaled(k_cache.dtype):
        assert k_scale is None and v_scale is None, f"a {k_cache.dtype} cache takes no scales"
        return
    checks = (
        (k_scale, kv_quant.KEY_SCALE_DTYPE, kv_quant.key_scale_shape(k_cache)),
        (v_scale, kv_quant.VALUE_SCALE_DTYPE, kv_quant.value_scale_shape(v_cache)),
    )
    for scale, dtype, expected in checks:
        assert scale is not None, "an int8 cache needs k_scale and v_scale"
        assert scale.dtype == dtype and tuple(scale.shape) == expected, (scale.dtype, scale.shape)


def _varlen_attention(
    q: Tensor,  # [total_query_tokens, num_heads, head_dim]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: Tensor,  # int [num_seqs + 1]
    context_lens: Tensor,  # int32 [num_seqs]
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    out: Tensor,  # [total_query_tokens, num_heads, head_dim]
    k_scale: Tensor | None = None,  # bfloat16 [num_blocks, num_kv_heads, head_dim] of an int8 cache
    v_scale: Tensor | None = None,
) -> None:
    """Run the sequences in padded groups (see `plan_groups`) and scatter each group's rows into `out`."""
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    lens = context_lens.long()
    q_list, ctx_list = q_lens.tolist(), lens.tolist()
    if sliding_window is None:
        keys = ctx_list
    else:
        keys = [min(ctx, n + sliding_window - 1) for n, ctx in zip(q_list, ctx_list, strict=True)]
    # A quantized cache is attended in the dtype a float cache of the model's would be (q's).
    stored = q.dtype if k_cache.dtype in QUANTIZED_DTYPES else k_cache.dtype
    dtype = torch_attention.compute_dtype(stored, logit_softcap)
    bytes_per_key = (
        2 * dtype.itemsize * k_cache.shape[2] * k_cache.shape[3]
    )  # gathered K and V of one position
    budget = GROUP_BYTES if q.device.type == "cpu" else DEVICE_GROUP_BYTES
    for seqs in plan_groups(q_list, keys, bytes_per_key, budget):
        seq_ids = torch.as_tensor(seqs, device=q.device, dtype=torch.long)
        group_lens = q_lens[seq_ids]
        width = max(q_list[i] for i in seqs)
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
            dtype,
            k_scale,
            v_scale,
        )
        if width == 1:
            out[token[:, 0]] = result[:, 0].to(out.dtype)
        else:
            real = rows < group_lens[:, None]
            out[token[real]] = result[real].to(out.dtype)


# Cache dtypes that hold quantized values of the model's activations (dequantized on every read).
QUANTIZED_DTYPES = (torch.int8, *kv_quant.FP8_DTYPES)
# Gathered K+V (in the compute dtype) of one group stays under this size (unless one sequence alone is larger). Since
# K/V are gathered a block per row, fewer and larger groups win: 110 decodes of ~410 keys (Gemma 3 270M) took 414 ms
# a step at 256 MB (one group) vs 472 ms at 16 MB and 587 ms at 4 MB in bfloat16, 720 vs 787 ms in float32.
GROUP_BYTES = 256 << 20
# On a GPU (where this backend is the reference) groups are only bounded to keep the gathered copies in memory.
DEVICE_GROUP_BYTES = 1 << 30
# Largest share of padding a group may carry, in query rows and in gathered keys. Padded prefills measured
# slower than one-by-one runs from about 20% query padding on (see README), so prompts are padded little.
_QUERY_PADDING = 0.1
_KEY_PADDING = 0.25


def plan_groups(
    q_lens: list[int], key_counts: list[int], bytes_per_key: int, budget: int = GROUP_BYTES
) -> list[list[int]]:
    """Sequences grouped for padded batching (q_len 0 skipped), by increasing (kind, q_len, keys).

    A sequence joins the current group when it is of the same kind (a whole prompt, which runs with SDPA's
    causal kernel and no mask, or not), padding the group to its q_len and key count stays within
    `_QUERY_PADDING` and `_KEY_PADDING`, and the group's padded K/V stay under `budget` bytes. Decodes of
    similar lengths share a group; a long prompt never pads the decodes of the same step.
    """

    def whole_prompt(i: int) -> bool:
        return q_lens[i] > 1 and q_lens[i] == key_counts[i]

    order = sorted(
        (i for i, n in enumerate(q_lens) if n > 0), key=lambda i: (whole_prompt(i), q_lens[i], key_counts[i])
    )
    groups: list[list[int]] = []
    tokens = keys = max_keys = 0
    for i in order:
        n, k = q_lens[i], key_counts[i]
        group = groups[-1] if groups else []
        size = len(group) + 1
        widest = max(max_keys, k)
        joins = (
            bool(group)
            and whole_prompt(group[0]) == whole_prompt(i)
            and size * n <= (1 + _QUERY_PADDING) * (tokens + n)
            and size * widest <= (1 + _KEY_PADDING) * (keys + k)
            and size * widest * bytes_per_key <= budget
        )
        if joins:
            group.append(i)
            tokens, keys, max_keys = tokens + n, keys + k, widest
        else:
            groups.append([i])
            tokens, keys, max_keys = n, k, k
    return groups


class TorchBackend:
    """The five ops in plain torch, on any device: what every other backend must compute."""

    __slots__ = ()
    name = "torch"

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
        """Write each token's key and value into cache slot `slot_mapping[t]`, skipping negative slots; an int8
        cache quantizes them and updates its scales (`kv_quant.write_int8_keys`, `write_int8_values`), an fp8 one
        rounds them."""
        check_scales(k_cache, v_cache, k_scale, v_scale)
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            # Padding present: drop it. Engines that never pad skip these boolean-mask copies (a tenth of a CPU
            # decode step when taken every layer).
            slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
        # view() (not reshape) so that a non-contiguous cache fails loudly instead of writing into a copy.
        # index_copy_ rather than `cache[slots] = ...`: index_put's CPU kernel parallelises even tiny writes and
        # stalls for milliseconds when the other core is busy; slots are unique so both mean the same.
        if k_scale is not None and v_scale is not None:
            kv_quant.write_int8_keys(key, k_cache, k_scale, slot_mapping)
            kv_quant.write_int8_values(value, v_cache, v_scale, slot_mapping)
            return
        if k_cache.dtype in kv_quant.FP8_DTYPES:
            # Written as bytes: torch's CPU index_copy_ has no fp8 kernel.
            key = kv_quant.to_fp8(key, k_cache.dtype).view(torch.uint8)
            value = kv_quant.to_fp8(value, v_cache.dtype).view(torch.uint8)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

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
        """Attention of one query per sequence, at position context_lens[i] - 1, over its paged K/V."""
        check_attention_args(q, k_cache, v_cache, k_scale, v_scale)
        if out is None:
            out = torch.empty_like(q)
        starts = torch.arange(q.shape[0] + 1, device=q.device)
        _varlen_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            starts,
            context_lens,
            scale,
            sliding_window,
            logit_softcap,
            out,
            k_scale,
            v_scale,
        )
        return out

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
        if out is None:
            out = torch.empty_like(q)
        _varlen_attention(
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
        return out

    def copy_blocks(
        self,
        k_caches: list[Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        v_caches: list[Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        block_pairs: Tensor,  # int64 [num_pairs, 2] (src, dst)
    ) -> None:
        """Copy block src to block dst in every layer's K and V cache (dst blocks must not also be sources)."""
        if block_pairs.numel() == 0:
            return
        for cache in [*k_caches, *v_caches]:
            pairs = block_pairs.to(cache.device)
            cache = kv_quant.as_bytes(cache)
            cache[pairs[:, 1]] = cache[pairs[:, 0]]

    def swap_blocks(
        self,
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
            src, dst = kv_quant.as_bytes(src), kv_quant.as_bytes(dst)
            dst[pairs[:, 1]] = src[pairs[:, 0]]
            return
        # One copy_ per block: blocks are contiguous, so each is a single DMA that overlaps with compute when the
        # host side is pinned; a gather on the host would need an unpinned temporary and a synchronous copy.
        for s, d in block_pairs.tolist():
            dst[d].copy_(src[s], non_blocking=True)
