"""Paged attention for one layer, and the per-step metadata the runner builds for every layer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypedDict

from pagoda.pagedkernel import KernelBackend
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class LayerKVCache:
    """One layer's paged cache; unpacks as (k_cache, v_cache). An int8 cache carries its scales (else None)."""

    k: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale: Tensor | None = None  # bfloat16 [num_blocks, num_kv_heads, head_dim], int8 caches only
    v_scale: Tensor | None = None  # float32 [num_blocks, block_size, num_kv_heads], int8 caches only

    def __iter__(self) -> Iterator[Tensor]:
        """k, then v: `k_cache, v_cache = layer_cache`, as when this was a pair."""
        yield self.k
        yield self.v


@dataclass(frozen=True)
class AttentionMetadata:
    """Where the step's tokens go in the paged KV cache and what each sequence attends to (shared by all layers)."""

    slot_mapping: Tensor  # int64 [num_tokens], cache slot of each token (negative = do not write)
    block_tables: Tensor  # int32 [num_seqs, max_blocks_per_seq]
    context_lens: Tensor  # int32 [num_seqs], tokens of each sequence including this step's
    query_start_loc: Tensor  # int32 [num_seqs + 1], sequence i's tokens are rows [start[i], start[i + 1])
    max_query_len: int
    is_decode: bool  # every sequence has exactly one query token this step
    backend: KernelBackend
    # With several KV cache groups, per group: int64 [num_tokens] slots and int32 [num_seqs, max_blocks] tables
    # (a layer uses its group's; empty: every layer uses the two above).
    group_slot_mappings: tuple[Tensor, ...] = ()
    group_block_tables: tuple[Tensor, ...] = ()


class _Scales(TypedDict, total=False):
    """The ops' scale keywords: given for an int8 cache only, so a float cache's calls are as they always were."""

    k_scale: Tensor  # bfloat16 [num_blocks, num_kv_heads, head_dim]
    v_scale: Tensor  # float32 [num_blocks, block_size, num_kv_heads]


def _scales(kv_cache: LayerKVCache) -> _Scales:
    """The scale keywords of one layer's cache (none for a float cache)."""
    if kv_cache.k_scale is None or kv_cache.v_scale is None:
        return {}
    return {"k_scale": kv_cache.k_scale, "v_scale": kv_cache.v_scale}


class Attention(nn.Module):
    """Write this step's keys/values into the layer's paged cache, then attend over each sequence's tokens."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        # The KV cache group whose block tables and slots this layer uses (set by the model runner).
        self.kv_cache_group = 0

    def forward(
        self,
        q: Tensor,  # [num_tokens, num_heads, head_dim]
        k: Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: LayerKVCache,
        attn: AttentionMetadata,
    ) -> Tensor:  # [num_tokens, num_heads * head_dim]
        """Attention output of every query token, heads flattened."""
        k_cache, v_cache = kv_cache
        scales = _scales(kv_cache)
        slot_mapping, block_tables = attn.slot_mapping, attn.block_tables
        if attn.group_block_tables:
            group = self.kv_cache_group
            slot_mapping, block_tables = attn.group_slot_mappings[group], attn.group_block_tables[group]
        attn.backend.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, **scales)
        if attn.is_decode:
            out = attn.backend.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                block_tables,
                attn.context_lens,
                self.scale,
                sliding_window=self.sliding_window,
                logit_softcap=self.logit_softcap,
                **scales,
            )
        else:
            out = attn.backend.paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                block_tables,
                attn.query_start_loc,
                attn.context_lens,
                self.scale,
                sliding_window=self.sliding_window,
                logit_softcap=self.logit_softcap,
                **scales,
            )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        """Shown by print(model)."""
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"scale={self.scale:.4g}, sliding_window={self.sliding_window}, logit_softcap={self.logit_softcap}"
        )
