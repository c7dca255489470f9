"""Vision-language models (Llava, Gemma 3) against transformers, their processors, and bidirectional image
attention on the paged kernels."""

from __future__ import annotations

import random

import pytest
import torch
from pagoda.pagedkernel import KernelBackend
from pagoda.server.models import Attention, AttentionMetadata, LayerKVCache
from pagoda.server.models.image_attention import bidirectional_metadata
from torch import Tensor

CPU = torch.device("cpu")


def _dense_reference(
    q: Tensor,  # [q_len, heads, d]: the chunk's queries, positions [first, first + q_len)
    keys: Tensor,  # [first + q_len, kv_heads, d]: every position's key
    values: Tensor,  # [first + q_len, kv_heads, d]
    images: list[tuple[int, int]],  # (first position, length) of each image
    scale: float,
) -> Tensor:  # [q_len, heads, d]
    """Masked dense attention: causal, plus every image's positions seeing the whole image."""
    total, q_len = keys.shape[0], q.shape[0]
    group = q.shape[1] // keys.shape[1]
    pos_q = torch.arange(total - q_len, total)[:, None]
    pos_k = torch.arange(total)[None, :]
    allowed = pos_k <= pos_q
    for start, length in images:
        inside_q = (pos_q >= start) & (pos_q < start + length)
        inside_k = (pos_k >= start) & (pos_k < start + length)
        allowed = allowed | (inside_q & inside_k)
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_bidirectional_metadata_matches_dense_masked_attention(torch_backend: KernelBackend) -> None:
    """Two sequences (one with cached context, one with two images, one without images) in one paged step."""
    heads, kv_heads, d, block, num_blocks = 4, 2, 8, 4, 32
    gen = torch.Generator().manual_seed(0)
    # (tokens already cached, chunk length, images as (offset in chunk, length))
    seqs = [(6, 17, [(3, 7)]), (0, 22, [(0, 5), (9, 6)]), (2, 5, [])]
    k_cache = torch.zeros(num_blocks, block, kv_heads, d)
    v_cache = torch.zeros(num_blocks, block, kv_heads, d)
    free = list(range(num_blocks))
    random.Random(1).shuffle(free)
    tables: list[list[int]] = []
    keys, values, queries, slots, starts, lens, spans = [], [], [], [], [0], [], []
    for index, (cached, q_len, images) in enumerate(seqs):
        total = cached + q_len
        table = [free.pop() for _ in range(-(-total // block))]
        tables.append(table)
        key = torch.randn(total, kv_heads, d, generator=gen)
        value = torch.randn(total, kv_heads, d, generator=gen)
        for pos in range(cached):  # the earlier steps' K/V, already in the cache
            k_cache[table[pos // block], pos % block] = key[pos]
            v_cache[table[pos // block], pos % block] = value[pos]
        keys.append(key)
        values.append(value)
        queries.append(torch.randn(q_len, heads, d, generator=gen))
        slots.extend(table[pos // block] * block + pos % block for pos in range(cached, total))
        starts.append(starts[-1] + q_len)
        lens.append(total)
        spans.extend((index, offset, length) for offset, length in images)
    width = max(len(t) for t in tables)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(q for _, q, _ in seqs),
        is_decode=False,
        backend=torch_backend,
    )
    bidi = bidirectional_metadata(attn, spans)
    layer = Attention(heads, kv_heads, d, d**-0.5)
    new_k = torch.cat([k[c:] for k, (c, _, _) in zip(keys, seqs, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _, _) in zip(values, seqs, strict=True)])
    got = layer(torch.cat(queries), new_k, new_v, LayerKVCache(k_cache, v_cache), bidi)
    want = torch.cat(
        [
            _dense_reference(q, k, v, [(cached + o, n) for o, n in images], d**-0.5)
            for q, k, v, (cached, _, images) in zip(queries, keys, values, seqs, strict=True)
        ]
    ).reshape(got.shape)
    # float32 softmax over <= 28 keys of O(1) scores: a few ulps of O(1) outputs.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # Without the rewrite the image rows differ (the test can fail).
    causal = Attention(heads, kv_heads, d, d**-0.5)(
        torch.cat(queries), new_k, new_v, LayerKVCache(k_cache, v_cache), attn
    )
    assert not torch.allclose(causal, want, atol=1e-3)
    assert bidi.slot_mapping is attn.slot_mapping and not bidi.is_decode


def test_bidirectional_metadata_refuses_a_span_past_the_chunk(torch_backend: KernelBackend) -> None:
    """An image that does not lie wholly inside its chunk is refused."""
    attn = AttentionMetadata(
        slot_mapping=torch.arange(4),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        context_lens=torch.tensor([4], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
        max_query_len=4,
        is_decode=False,
        backend=torch_backend,
    )
    with pytest.raises(ValueError, match="not a disjoint part"):
        bidirectional_metadata(attn, [(0, 2, 3)])
