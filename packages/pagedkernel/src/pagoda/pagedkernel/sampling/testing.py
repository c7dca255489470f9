"""Test helpers for every sampling backend: logits with ties and -inf, a sort-based mask reference, and the exact
distribution a row samples from."""

from __future__ import annotations

import torch
from pagoda.pagedkernel.sampling.fmath import exp32
from pagoda.pagedkernel.sampling.params import MASS_BITS, SamplingTensors
from torch import Tensor


def tricky_logits(
    rows: int,
    vocab: int,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Tensor:  # [rows, vocab]
    """Random logits on a coarse grid (many exact ties), ~20% -inf, and special rows: row 0 all -inf but one,
    row 1 all equal, row 2 two tied maxima. Values are exact in bfloat16 too."""
    g = torch.Generator().manual_seed(seed)
    x = torch.round(torch.randn(rows, vocab, generator=g) * 12.0) / 4.0  # steps of 0.25, |x| < ~15
    x[torch.rand(rows, vocab, generator=g) < 0.2] = float("-inf")
    if rows > 0:
        x[0] = float("-inf")
        x[0, vocab // 3] = 1.5
    if rows > 1:
        x[1] = 0.75
    if rows > 2 and vocab > 4:
        x[2, 1] = x[2, 4] = float(x[2].max()) + 1.0
    return x.to(dtype)


def sorted_kept_mask(
    x: Tensor,  # float32 [vocab]: one row of logits * (1 / T), no NaN or +inf, not all -inf
    top_k: int,  # 0: disabled
    top_p: float,  # 1: disabled
    min_p: float,  # 0: disabled
) -> Tensor:  # bool [vocab]
    """The kept set by sorting, written independently of the backends: min_p, then top_k, then top_p."""
    vocab = x.shape[0]
    e = exp32(x - x.max())
    keep = (x > float("-inf")) & (e >= torch.tensor(min_p, dtype=torch.float32))
    if 0 < top_k < vocab:
        values = x[keep].sort(descending=True).values
        if values.numel() >= top_k:
            keep &= x >= values[top_k - 1]
    if top_p < 1.0:
        mass = torch.where(keep, (e * 2.0**MASS_BITS).to(torch.int64), 0)
        kept_x = torch.where(keep, x, float("-inf"))
        order = torch.sort(kept_x, descending=True, stable=True).indices
        sorted_x, sorted_mass = kept_x[order].tolist(), mass[order].tolist()
        limit = float(torch.tensor(top_p, dtype=torch.float32)) * float(sum(sorted_mass))
        drop = torch.ones(vocab, dtype=torch.bool)
        above = 0  # mass of the tokens strictly above the current tie group
        start = 0
        while start < vocab:
            end = start
            while end < vocab and sorted_x[end] == sorted_x[start]:
                end += 1
            if float(above) < limit:
                drop[order[start:end]] = False
            above += sum(sorted_mass[start:end])
            start = end
        keep &= ~drop
    return keep


def exact_probabilities(
    x: Tensor,  # float32 [vocab]: logits * (1 / T)
    kept: Tensor,  # bool [vocab]
) -> Tensor:  # float64 [vocab]
    """softmax(x) over the kept tokens, in float64: what the Gumbel-max draw samples from."""
    z = torch.where(kept, x.to(torch.float64), float("-inf"))
    return torch.softmax(z, dim=0)


def select_rows(
    params: SamplingTensors,
    rows: list[int] | slice,
) -> SamplingTensors:
    """The parameters of some rows only."""
    return SamplingTensors(
        temperature=params.temperature[rows],
        top_k=params.top_k[rows],
        top_p=params.top_p[rows],
        min_p=params.min_p[rows],
        keys=params.keys[rows],
    )
