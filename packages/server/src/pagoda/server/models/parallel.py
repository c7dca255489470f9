"""Tensor-parallel ranks as the model sees them: the collectives its layers call, and how heads are split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor
from transformers import PretrainedConfig


class ParallelGroup(Protocol):
    """The ranks one model is split over; every rank calls each collective in the same order."""

    @property
    def rank(self) -> int:
        """This rank, 0 being the driver (the engine's process)."""
        ...

    @property
    def size(self) -> int:
        """Number of ranks."""
        ...

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of `x` over the ranks, on every rank (in place where possible)."""
        ...

    def gather_last_dim(self, x: Tensor) -> Tensor:
        """On rank 0 the ranks' `x` concatenated along the last dimension, in rank order; elsewhere `x`."""
        ...

    def broadcast(self, x: Tensor) -> Tensor:
        """Rank 0's `x` on every rank (same shape and dtype everywhere)."""
        ...


@dataclass(frozen=True, slots=True)
class SingleRank:
    """The group of one: every collective is the identity (today's single-process path, unchanged)."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: Tensor) -> Tensor:
        """`x` itself."""
        return x

    def gather_last_dim(self, x: Tensor) -> Tensor:
        """`x` itself."""
        return x

    def broadcast(self, x: Tensor) -> Tensor:
        """`x` itself."""
        return x


class TensorParallelError(ValueError):
    """The model cannot be split over that many ranks (the message names the head count that forbids it)."""


def check_tensor_parallel(
    config: PretrainedConfig,
    size: int,
    name: str = "tensor_parallel_size",
    hint: str = "choose a --tensor-parallel-size that divides it",
) -> None:
    """Refuse a `size` that the config's attention heads, KV heads or MLP width cannot be split over; the message
    names the setting (`name`) and says what to change (`hint`)."""
    if size == 1:
        return
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    inner = int(config.intermediate_size)
    if heads % size:
        raise TensorParallelError(
            f"{name} {size} must divide num_attention_heads ({heads}) of this model; {hint}"
        )
    if kv_heads % size and size % kv_heads:
        raise TensorParallelError(
            f"{name} {size} and num_key_value_heads ({kv_heads}) must divide one another (KV heads are split "
            f"when there are more than ranks, replicated when fewer); {hint}"
        )
    if inner % size:
        raise TensorParallelError(
            f"{name} {size} must divide intermediate_size ({inner}) of this model; {hint}"
        )


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The attention heads one rank owns: a run of query heads and the KV heads they read."""

    num_heads: int  # query heads on this rank
    first_head: int  # global index of its first query head
    num_kv_heads: int  # KV heads on this rank (1 when the model has fewer KV heads than ranks)
    first_kv_head: int  # global index of its first KV head


def head_shard(num_heads: int, num_kv_heads: int, group: ParallelGroup) -> HeadShard:
    """Split query heads evenly; split KV heads too, or give each rank the one KV head its query heads read.

    With fewer KV heads than ranks, ranks r * kv / size share KV head r * kv // size: query heads of one group
    (num_heads / num_kv_heads of them) are consecutive, and each rank's run lies inside one group.
    """
    per_rank = num_heads // group.size
    if num_kv_heads >= group.size:
        kv_per_rank = num_kv_heads // group.size
        return HeadShard(per_rank, group.rank * per_rank, kv_per_rank, group.rank * kv_per_rank)
    return HeadShard(per_rank, group.rank * per_rank, 1, group.rank * num_kv_heads // group.size)
