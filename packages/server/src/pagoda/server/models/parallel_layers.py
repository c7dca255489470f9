"""Tensor-parallel layers (vLLM's names): each rank holds a slice of a weight and says which checkpoint slice.

Column-parallel layers split output rows (fused QKV by heads, gate/up by width, each checkpoint projection
separately), row-parallel layers split input columns and all-reduce their partial products, the vocabulary is
split in equal runs of rows (the last padded with zeros). With a group of one every layer is its plain self.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagoda.server.models.layers import Embedding, Linear, MergedLinear, head_dim_of
from pagoda.server.models.parallel import ParallelGroup, head_shard
from torch import Tensor
from transformers import PretrainedConfig


@dataclass(frozen=True, slots=True)
class SourceSlice:
    """The part of a checkpoint tensor one rank loads: `length` entries of dimension `dim` from `start`."""

    dim: int
    start: int
    length: int
    full: int  # the checkpoint tensor's size along `dim`


class SlicedLoad(ABC):
    """A module whose parameters hold a slice of the checkpoint's tensors (with more than one rank)."""

    @abstractmethod
    def source_slice(self, attr: str, shard: int | None) -> SourceSlice | None:
        """The checkpoint slice parameter `attr` (fused shard `shard`) holds; None: the whole tensor."""


class MergedColumnParallelLinear(MergedLinear, SlicedLoad):
    """Fused projections of equal split (gate/up): each rank holds rows [rank * s / size, ...) of each one."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: Sequence[int],  # of the whole model
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup,
    ) -> None:
        local = [size // group.size for size in shard_sizes]
        super().__init__(in_features, local, bias=bias, dtype=dtype, device=device)
        self.whole = group.size == 1
        self.sources = [
            SourceSlice(0, group.rank * rows, rows, full)
            for rows, full in zip(local, shard_sizes, strict=True)
        ]

    def source_slice(self, attr: str, shard: int | None) -> SourceSlice | None:
        """Rows of this rank in checkpoint projection `shard` (weight and bias alike)."""
        return None if shard is None or self.whole else self.sources[shard]


class QKVParallelLinear(MergedColumnParallelLinear):
    """The fused q/k/v projection split by heads; KV heads are replicated when there are fewer than ranks."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup,
    ) -> None:
        heads = head_shard(num_heads, num_kv_heads, group)
        q_rows, kv_rows = heads.num_heads * head_dim, heads.num_kv_heads * head_dim
        MergedLinear.__init__(self, hidden, [q_rows, kv_rows, kv_rows], bias=bias, dtype=dtype, device=device)
        self.heads = heads
        self.whole = group.size == 1
        kv = SourceSlice(0, heads.first_kv_head * head_dim, kv_rows, num_kv_heads * head_dim)
        self.sources = [SourceSlice(0, heads.first_head * head_dim, q_rows, num_heads * head_dim), kv, kv]


def attention_projections(
    config: PretrainedConfig,
    *,
    qkv_bias: bool,
    o_bias: bool,
    dtype: torch.dtype,
    device: torch.device,
    group: ParallelGroup,
) -> tuple[QKVParallelLinear, RowParallelLinear]:
    """The fused q/k/v projection and the output projection of one attention layer, split by heads."""
    hidden, head_dim = int(config.hidden_size), head_dim_of(config)
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    qkv = QKVParallelLinear(
        hidden, head_dim, num_heads, num_kv_heads, bias=qkv_bias, dtype=dtype, device=device, group=group
    )
    out = RowParallelLinear(
        num_heads * head_dim, hidden, bias=o_bias, dtype=dtype, device=device, group=group
    )
    return qkv, out


class RowParallelLinear(Linear, SlicedLoad):
    """Input columns split over the ranks; the partial products are summed by an all-reduce, then the bias."""

    def __init__(
        self,
        in_features: int,  # of the whole model
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup,
    ) -> None:
        local = in_features // group.size
        super().__init__(local, out_features, bias=bias, dtype=dtype, device=device)
        self.group = group
        self.source = SourceSlice(1, group.rank * local, local, in_features)

    def forward(self, x: Tensor) -> Tensor:  # [..., in_features / size] -> [..., out_features]
        """x_r W_r^T summed over ranks r, plus the bias once."""
        if self.group.size == 1:
            return self.matmul(x, self.bias)
        out = self.group.all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias

    def source_slice(self, attr: str, shard: int | None) -> SourceSlice | None:
        """The weight's columns of this rank; the bias is whole on every rank."""
        return self.source if attr == "weight" and self.group.size > 1 else None


@dataclass(frozen=True, slots=True)
class VocabRun:
    """The rows of a vocabulary-sized table one rank holds: `per` = ceil(vocab / size) from `first`."""

    num_embeddings: int  # the whole vocabulary
    per: int  # rows on every rank (the last one's past the vocabulary are 0)
    first: int  # global id of this rank's first row
    num_real: int  # rows of this rank inside the vocabulary

    @classmethod
    def of(cls, num_embeddings: int, group: ParallelGroup) -> VocabRun:
        """This rank's run of a `num_embeddings` vocabulary."""
        per = -(-num_embeddings // group.size)
        first = group.rank * per
        return cls(num_embeddings, per, first, max(0, min(per, num_embeddings - first)))

    def source(self) -> SourceSlice | None:
        """The checkpoint rows of the run (fewer than the table's rows on a padded last rank); None: all rows."""
        if self.num_real == self.num_embeddings:
            return None
        return SourceSlice(0, self.first, self.num_real, self.num_embeddings)


class VocabParallelEmbedding(Embedding, SlicedLoad):
    """This rank's `VocabRun` of the embedding table (also the LM head when embeddings are tied)."""

    def __init__(
        self, num_embeddings: int, dim: int, *, dtype: torch.dtype, device: torch.device, group: ParallelGroup
    ) -> None:
        run = VocabRun.of(num_embeddings, group)
        super().__init__(run.per, dim, dtype=dtype, device=device)
        self.group = group
        self.run = run
        with torch.no_grad():
            self.weight[run.num_real :].zero_()

    def forward(self, ids: Tensor) -> Tensor:  # int64 [num_tokens] -> [num_tokens, dim]
        """Each rank looks up the ids in its run (zeros for the others); the all-reduce assembles the rows."""
        if self.group.size == 1:
            return super().forward(ids)
        local = ids - self.run.first
        outside = (local < 0) | (local >= self.run.num_real)
        rows = self.lookup(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0.0)
        if self.lora is not None:  # each rank adds the delta of the ids in its run, before the all-reduce
            rows = self.lora(local.masked_fill(outside, -1), rows)
        return self.group.all_reduce(rows)

    def quantized_rows(self) -> int:
        """The run's rows inside the vocabulary (the padding rows are not stored)."""
        return self.run.num_real

    def scores(self, hidden: Tensor) -> Tensor:  # [num_rows, dim] -> [num_rows, per]
        """hidden W^T over this run (as the tied LM head); see `run_scores`."""
        return run_scores(self, self.run, hidden)

    def source_slice(self, attr: str, shard: int | None) -> SourceSlice | None:
        """The checkpoint rows of this rank's run."""
        return self.run.source()


class ParallelLMHead(Linear, SlicedLoad):
    """An untied LM head [vocab, hidden], split over the vocabulary like the embedding; each rank scores its run
    and rank 0 gathers the runs (`gather_logits`)."""

    def __init__(
        self, num_embeddings: int, dim: int, *, dtype: torch.dtype, device: torch.device, group: ParallelGroup
    ) -> None:
        run = VocabRun.of(num_embeddings, group)
        super().__init__(dim, run.per, bias=False, dtype=dtype, device=device)
        self.run = run
        with torch.no_grad():
            self.weight[run.num_real :].zero_()

    def source_slice(self, attr: str, shard: int | None) -> SourceSlice | None:
        """The checkpoint rows of this rank's run."""
        return self.run.source()

    def quantized_rows(self) -> int:
        """The run's rows inside the vocabulary (the padding rows are not stored)."""
        return self.run.num_real

    def scores(self, hidden: Tensor) -> Tensor:  # [num_rows, dim] -> [num_rows, per]
        """hidden W^T over this run; see `run_scores`."""
        return run_scores(self, self.run, hidden)


def run_scores(
    table: Embedding | Linear,
    run: VocabRun,
    hidden: Tensor,  # [num_rows, dim]
) -> Tensor:  # [num_rows, run.per]
    """Logits of a vocabulary run through its quantized table; the padding rows score 0, as their zero rows do."""
    assert table.quantized is not None
    logits = table.quantized.matmul(hidden)
    pad = run.per - logits.shape[-1]
    return F.pad(logits, (0, pad)) if pad else logits


def gather_logits(
    group: ParallelGroup,
    local: Tensor,  # [num_rows, ceil(vocab / size)]: this rank's run of the vocabulary
    vocab_size: int,
) -> Tensor:  # [num_rows, vocab_size] on rank 0; `local` elsewhere
    """Rank 0 concatenates the ranks' runs (and drops the padding); the other ranks keep their run."""
    if group.size == 1:
        return local
    full = group.gather_last_dim(local)
    if group.rank != 0 or full.shape[-1] == vocab_size:
        return full
    return full[:, :vocab_size].contiguous()
