"""The `torch` backend of the LoRA ops, and their specification: per distinct slot, one matmul over its rows."""

from __future__ import annotations

import torch
from torch import Tensor


def slot_rows(slots: Tensor) -> list[tuple[int, Tensor]]:  # slots: int64 [num_tokens]
    """(slot, int64 row indices) of every slot the batch uses; rows with a negative slot are left out."""
    used = torch.unique(slots)
    return [(int(s), torch.nonzero(slots == s).flatten()) for s in used.tolist() if s >= 0]


def lora_shrink(
    x: Tensor,  # [num_tokens, in_features]
    a: Tensor,  # [num_slots, rank, in_features]
    slots: Tensor,  # int64 [num_tokens]; negative: no adapter
    scales: Tensor,  # float32 [num_slots]
) -> Tensor:  # float32 [num_tokens, rank]
    """h[t] = scales[s] * x[t] @ a[s]^T in float32 for s = slots[t]; rows without an adapter are 0."""
    h = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for slot, rows in slot_rows(slots):
        h[rows] = (x[rows].float() @ a[slot].float().t()) * scales[slot].float()
    return h


def lora_expand(
    h: Tensor,  # float32 [num_tokens, rank]
    b: Tensor,  # [num_slots, out_features, rank]
    slots: Tensor,  # int64 [num_tokens]; negative: no adapter
    y: Tensor,  # [num_tokens, >= offset + out_features], updated in place
    offset: int,
) -> None:
    """y[t, offset:offset + out_features] += h[t] @ b[s]^T (summed in float32, rounded once to y's dtype)."""
    width = b.shape[1]
    for slot, rows in slot_rows(slots):
        part = y[rows, offset : offset + width]
        y[rows, offset : offset + width] = (part.float() + h[rows] @ b[slot].float().t()).to(y.dtype)


def lora_embedding_shrink(
    ids: Tensor,  # int64 [num_tokens]
    a: Tensor,  # [num_slots, vocab, rank]: each slot's A transposed, one row per token id
    slots: Tensor,  # int64 [num_tokens]; negative: no adapter
    scales: Tensor,  # float32 [num_slots]
) -> Tensor:  # float32 [num_tokens, rank]
    """h[t] = scales[s] * a[s, ids[t]] in float32 for s = slots[t] (the embedding's shrink is a lookup, PEFT's
    `F.embedding(x, lora_embedding_A.T)`); rows without an adapter are 0."""
    h = torch.zeros((ids.shape[0], a.shape[2]), dtype=torch.float32, device=ids.device)
    for slot, rows in slot_rows(slots):
        h[rows] = a[slot, ids[rows]].float() * scales[slot].float()
    return h
