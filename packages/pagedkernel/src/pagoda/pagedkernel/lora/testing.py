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


# Unit roundoff (half an ulp at 1: round to nearest) of each storage dtype: 8, 11 and 24 bits of significand.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def add_error_bound(
    case: LoRACase, offset: int, *, truncating: bool = False, delta_rounded: bool = False
) -> Tensor:  # float64 [num_tokens, width]
    """The most an add that sums in float32 and rounds y once to its dtype can differ from `reference_add`.

    Both read the same stored x, A, B, y (already rounded to the case's dtype), so rounding the inputs is no
    error; what is left is float32 accumulation in any order and the one rounding of the result:
      h_r = s (a_r . x): K products (exact in float32 for bfloat16 / float16 inputs, 8 + 8 or 11 + 11 bits) and
        sums, and the scale's product: |err| <= gamma_{K+1} |s| (|a_r| . |x|)  (Higham, gamma_n = n u32 / (1 - n u32),
        u32 = 2^-24);
      v = y + sum_r b_r h_r in float32: rank + 1 more terms, so |v - exact| <= gamma_{K+R+2} M, with
        M = |y| + |B| (|s| |A| |x|) (the errors of h carried through |B| included);
      the result is v rounded to y's dtype: |round(v) - v| <= u |v| <= u (|exact| + gamma M), u = UNIT_ROUNDOFF.
    So |got - exact| <= u |exact| + (1 + u) gamma_{K+R+2} M. For bfloat16 the first term dominates: 2^-8 = 0.39%
    of each output, the one rounding that storing a bfloat16 result costs; the float32 part is ~1e-5 of M.

    `truncating`: the rounding chops instead (Triton's CPU interpreter casts float32 to bfloat16 so, where a GPU
    rounds to nearest): a whole ulp, 2u. `delta_rounded`: the delta is rounded to y's dtype before a second
    rounding add (torch's index_add_ of a bfloat16 delta): u |delta| more, |delta| <= |B| (|s| |A| |x|).
    Rows without an adapter and columns outside [offset, offset + out_features) are untouched: bound 0.
    """
    k, rank = case.x.shape[1], case.a.shape[1]
    n = k + rank + 2
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    u = UNIT_ROUNDOFF[case.y.dtype] * (2 if truncating else 1)
    exact = reference_add(case, offset)
    delta = torch.zeros_like(exact)
    width = case.b.shape[1]
    for t, slot in enumerate(case.slots.tolist()):
        if slot >= 0:
            h = case.scales[slot].double().abs() * (case.a[slot].double().abs() @ case.x[t].double().abs())
            delta[t, offset : offset + width] = case.b[slot].double().abs() @ h
    magnitude = case.y.double().abs() + delta
    bound = u * exact.abs() + (1 + u) * gamma * magnitude
    if delta_rounded:
        bound += (1 + u) * u * delta
    untouched = torch.ones_like(bound, dtype=torch.bool)
    untouched[:, offset : offset + width] = False
    untouched[case.slots < 0] = True
    bound[untouched] = 0.0
    return bound


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
