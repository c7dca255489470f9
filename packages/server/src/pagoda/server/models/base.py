"""What every model offers the runner: the `CausalLM` base class and the shape of its KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from pagoda.server.models.attention import AttentionMetadata, KVCache
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The per-layer KV cache a model needs: `num_layers` pairs of [blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class PackedShard:
    """Where a checkpoint projection lands inside a fused one: shard `index` of module `module`."""

    module: str
    index: int


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over a flat varlen batch and a paged KV cache.

    Parameter names follow the Hugging Face checkpoint names, except for the fused projections that
    `packed_modules` lists (checkpoint `q_proj`, `k_proj`, `v_proj` fill shards 0, 1, 2 of `qkv_proj`, and so on).
    """

    # Checkpoint module name -> the fused module (sibling of the checkpoint one) and shard it fills.
    packed_modules: ClassVar[Mapping[str, PackedShard]] = MappingProxyType({})

    @abstractmethod
    def forward(
        self,
        input_ids: Tensor,  # int64 [num_tokens]
        positions: Tensor,  # int64 [num_tokens]
        kv_caches: Sequence[KVCache],  # one per layer
        attn: AttentionMetadata,
    ) -> Tensor:  # [num_tokens, hidden_size]
        """The final hidden state of every token, writing the tokens' K/V into the caches on the way."""

    @abstractmethod
    def compute_logits(
        self,
        hidden: Tensor,  # [num_rows, hidden_size]
    ) -> Tensor:  # float32 [num_rows, vocab_size]
        """Next-token logits for the given rows only (the runner passes the rows it samples)."""

    @abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec:
        """The KV cache layout this model reads and writes (its dtype is the model's)."""

    def weight_aliases(self) -> Mapping[str, str]:
        """Checkpoint names that load into another name's parameter (a tied `lm_head.weight` is the embedding)."""
        return {}

    def ignored_weights(self) -> frozenset[str]:
        """Checkpoint tensors that may be present but are not parameters here (e.g. stored rotary tables)."""
        return frozenset()
