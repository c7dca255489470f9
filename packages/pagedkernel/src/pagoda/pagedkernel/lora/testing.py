"""Random multi-LoRA batches and the dense float64 reference the LoRA ops' tests compare every backend against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class LoRACase:
    """One batch: rows x, a pool of adapters (a, b, scales), each row's slot (negative: none) and y."""

    x: Tensor  # [num_tokens, in_features]
    a: Tensor  # [num_slots, rank, in_features]
    b: Tensor  # [num_slots, out_features, rank]
    slots: Tensor  # int64 [num_tokens]
    scales: Tensor  # float32 [num_slots]
    y: Tensor  # [num_tokens, width]: the base output the delta is added to


def make_case(
    num_tokens: int,
    in_features: int,
    out_features: int,
    rank: int,
    num_slots: int,
    *,
    dtype: torch.dtype = torch.float32,
    width: int | None = None,  # columns of y (>= out_features; a fused projection's width)
    seed: int = 0,
) -> LoRACase:
    """Random inputs where about a third of the rows have no adapter and the others use every slot."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=g, dtype=torch.int64)
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1
    return LoRACase(
        x=torch.randn(num_tokens, in_features, generator=g).to(dtype),
        a=(torch.randn(num_slots, rank, in_features, generator=g) / in_features**0.5).to(dtype),
        b=torch.randn(num_slots, out_features, rank, generator=g).to(dtype),
        slots=slots,
        scales=torch.rand(num_slots, generator=g) + 0.5,
        y=torch.randn(num_tokens, width or out_features, generator=g).to(dtype),
    )


def reference_shrink(case: LoRACase) -> Tensor:  # float64 [num_tokens, rank]
    """h row by row in float64 (zeros for rows without an adapter)."""
    h = torch.zeros(case.x.shape[0], case.a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(case.slots.tolist()):
        if slot >= 0:
            h[t] = case.scales[slot].double() * (case.a[slot].double() @ case.x[t].double())
    return h


def reference_add(case: LoRACase, offset: int) -> Tensor:  # float64 [num_tokens, width]
    """y plus each row's adapter delta in columns offset.., row by row in float64."""
    y = case.y.double().clone()
    h = reference_shrink(case)
    width = case.b.shape[1]
    for t, slot in enumerate(case.slots.tolist()):
        if slot >= 0:
            y[t, offset : offset + width] += case.b[slot].double() @ h[t]
    return y


@dataclass(frozen=True, slots=True)
class EmbeddingCase:
    """One embedding batch: token ids, a pool of transposed A tables, each row's slot (negative: none)."""

    ids: Tensor  # int64 [num_tokens]
    a: Tensor  # [num_slots, vocab, rank]
    slots: Tensor  # int64 [num_tokens]
    scales: Tensor  # float32 [num_slots]


def make_embedding_case(
    num_tokens: int,
    vocab: int,
    rank: int,
    num_slots: int,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> EmbeddingCase:
    """Random ids and tables, about a third of the rows without an adapter."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=g, dtype=torch.int64)
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1
    return EmbeddingCase(
        ids=torch.randint(0, vocab, (num_tokens,), generator=g, dtype=torch.int64),
        a=torch.randn(num_slots, vocab, rank, generator=g).to(dtype),
        slots=slots,
        scales=torch.rand(num_slots, generator=g) + 0.5,
    )


def reference_embedding_shrink(case: EmbeddingCase) -> Tensor:  # float64 [num_tokens, rank]
    """Each adapter row's looked-up A row, scaled, in float64 (zeros for rows without an adapter)."""
    h = torch.zeros(case.ids.shape[0], case.a.shape[2], dtype=torch.float64)
    for t, (slot, token) in enumerate(zip(case.slots.tolist(), case.ids.tolist(), strict=True)):
        if slot >= 0:
            h[t] = case.scales[slot].double() * case.a[slot, token].double()
    return h
