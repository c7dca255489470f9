"""What every model offers the runner: the `CausalLM` base class and the shape of its KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Protocol

from pagoda.server.models.attention import AttentionMetadata, LayerKVCache
from pagoda.server.models.layers import Linear, OutputHook, head_dim_of, linear, pack_weight, softcap
from pagoda.server.models.parallel import ParallelGroup, head_shard
from pagoda.server.models.parallel_layers import ParallelLMHead, VocabParallelEmbedding, gather_logits
from torch import Tensor, nn
from transformers import PretrainedConfig


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The per-layer KV cache a model needs: `num_layers` pairs of [blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def sharded_kv_spec(config: PretrainedConfig, num_layers: int, group: ParallelGroup) -> KVCacheSpec:
    """The KV cache of one rank: its KV heads only (one, replicated, when the model has fewer than ranks)."""
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    return KVCacheSpec(
        num_layers, head_shard(num_heads, num_kv_heads, group).num_kv_heads, head_dim_of(config)
    )


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
    # False under the pooling runner (set by the engine's setup on every rank): no step needs the LM head, so the
    # runner hands back zero-width logits rows (a held pooling row is not read) instead of a 262k-wide product.
    computes_logits: bool = True

    @abstractmethod
    def forward(
        self,
        input_ids: Tensor,  # int64 [num_tokens]
        positions: Tensor,  # int64 [num_tokens]
        kv_caches: Sequence[LayerKVCache],  # one per layer
        attn: AttentionMetadata,
    ) -> Tensor:  # [num_tokens, hidden_size]
        """The final hidden state of every token, writing the tokens' K/V into the caches on the way."""

    @abstractmethod
    def compute_logits(
        self,
        hidden: Tensor,  # [num_rows, hidden_size]
    ) -> Tensor:  # [num_rows, vocab_size] in the model's dtype, or float32 where a final softcap applies
        """Next-token logits for the given rows only (the runner passes the rows it samples).

        Left in the model's dtype: the sampler upcasts only when it needs more than an argmax, which a vocab-wide
        float32 copy per step would otherwise cost every greedy batch (25 ms at 96 rows of a 262k vocabulary).
        """

    @abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec:
        """The KV cache layout this model reads and writes (its dtype is the model's)."""

    def weight_aliases(self) -> Mapping[str, str]:
        """Checkpoint names that load into another name's parameter (a tied `lm_head.weight` is the embedding)."""
        return {}

    def checkpoint_name(self, name: str) -> str:
        """The name a checkpoint tensor loads as, before aliases (a vision-language model maps the layouts its
        checkpoints come in onto its own); `name` itself by default."""
        return name

    def classifier(self) -> Linear | None:
        """A sequence-classification model's head (`score`: hidden_size -> num_labels, whole on every rank), which
        the pooling runner applies to the pooled row; None for a language model."""
        return None

    def ignored_weights(self) -> frozenset[str]:
        """Checkpoint tensors that may be present but are not parameters here (e.g. stored rotary tables)."""
        return frozenset()

    def pack_weights(self, batch_size: int) -> int:
        """Pack every `Linear` weight for batches of about `batch_size` rows (see `pack_weight`: float32, and
        bfloat16 where native, on a CPU with oneDNN; elsewhere nothing changes), after loading; the number of
        weights packed."""
        return sum(m.pack(batch_size) for m in self.modules() if isinstance(m, Linear))


# Checkpoint projections fused into one matmul each by every model here: q/k/v -> qkv_proj, gate/up -> gate_up_proj.
FUSED_QKV_GATE_UP: Mapping[str, PackedShard] = MappingProxyType(
    {
        "q_proj": PackedShard("qkv_proj", 0),
        "k_proj": PackedShard("qkv_proj", 1),
        "v_proj": PackedShard("qkv_proj", 2),
        "gate_proj": PackedShard("gate_up_proj", 0),
        "up_proj": PackedShard("gate_up_proj", 1),
    }
)


class NativeState(Protocol):
    """Something a native kernel path keeps about a model's memory (a table of addresses, a head's blocks)."""

    def forget(self) -> None:
        """Drop it: it is looked up or built again at the next step."""
        ...


class DecoderLM(CausalLM):
    """A decoder-only LM with `model.embed_tokens`, an optional untied `lm_head` and optional final softcap."""

    packed_modules = FUSED_QKV_GATE_UP
    model: nn.Module
    spec: KVCacheSpec
    group: ParallelGroup  # the tensor-parallel ranks this model is split over
    lm_head: ParallelLMHead | None  # None when tied to the embedding
    tie_word_embeddings: bool
    final_logit_softcapping: float | None = None
    # A packed copy of the tied embedding for the LM head (the lookups need the plain one), set by pack_weights.
    packed_head: Tensor | None = None
    # Set with LoRA: adds each sampled row's LM-head adapter delta to its logits (this rank's run), before softcap.
    head_lora: OutputHook | None = None
    # What the model's native paths keep about its memory (the native decode stack, the fused head's blocks).
    native_states: tuple[NativeState, ...] = ()

    def memory_moved(self) -> None:
        """Its weights or KV caches moved (sleep mode woke) or LoRA hooks came: native paths look them up again."""
        for state in self.native_states:
            state.forget()

    def head(self) -> ParallelLMHead | VocabParallelEmbedding:
        """The LM head: `lm_head`, or the embedding when tied."""
        if self.lm_head is not None:
            return self.lm_head
        embed = self.model.get_submodule("embed_tokens")
        assert isinstance(embed, VocabParallelEmbedding)
        return embed

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [num_rows, hidden] -> [num_rows, vocab]
        """Logits of the given rows through the LM head (the embedding matrix when tied), soft-capped (in float32)
        if set; with tensor parallelism each rank scores its run of the vocabulary and rank 0 gathers them."""
        head = self.head()
        if head.quantized is not None:
            logits = head.scores(hidden)
        else:
            logits = linear(hidden, head.weight if self.packed_head is None else self.packed_head)
        if self.head_lora is not None:
            logits = self.head_lora(hidden, logits)
        if self.final_logit_softcapping is not None:
            logits = softcap(logits.float(), float(self.final_logit_softcapping))
        return gather_logits(self.group, logits, head.run.num_embeddings)

    def kv_cache_spec(self) -> KVCacheSpec:
        """One K and one V cache per layer."""
        return self.spec

    def pack_weights(self, batch_size: int) -> int:
        """Also pack a copy of a tied LM head, where logits are computed (not under the pooling runner): the
        largest matmul of a step (the default model: 671 MB in float32, 262k x 640, worth keeping twice for a 7%
        faster LM head; bfloat16: 22% at one row)."""
        packed = super().pack_weights(batch_size)
        if self.computes_logits and self.lm_head is None and self.head().quantized is None:
            self.packed_head = pack_weight(self.head().weight, batch_size)
            packed += self.packed_head is not None
        return packed

    def weight_aliases(self) -> Mapping[str, str]:
        """With tied embeddings, a checkpoint's `lm_head.weight` is the embedding."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.tie_word_embeddings else {}
