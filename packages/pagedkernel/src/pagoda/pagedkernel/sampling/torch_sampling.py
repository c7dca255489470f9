"""The torch backend of the sampling op: the specification, written for clarity; it runs on any device.

Per sampled row (temperature T >= GREEDY_TEMPERATURE), with every quantity in float32 unless said otherwise:
1. x = logits * float32(1 / T); m = max x.
2. e = exp32(x - m) (fmath: the same bits on every backend); min_p keeps e >= min_p (and x > -inf).
3. top_k keeps, among those, the tokens with fewer than k kept tokens strictly above them (ties at the k-th value
   are all kept, as a sort-based `x >= kth value` rule does).
4. top_p keeps, among those, the tokens whose strictly-more-likely kept mass is below top_p of the kept mass. Masses
   are w = trunc(e * 2^32) in int64 (exact sums, in any order); the test is float64(top_p) * float64(W) >
   float64(mass above). Ties at the threshold are all kept; tokens of zero mass are dropped.
5. token = argmax over the kept tokens of x - log32(-log32(u)) (Gumbel-max, u from rng.uniforms), the lowest
   index on ties.
Greedy rows take the argmax of the logits (lowest index on ties). Thresholds are found without sorting: top_k by
torch.topk (selection), top_p by a 32-step bisection over the order-preserving integer keys of x.
"""

from __future__ import annotations

import torch
from pagoda.pagedkernel.sampling.fmath import exp32, log32
from pagoda.pagedkernel.sampling.params import MASS_BITS, SampleStatus
from pagoda.pagedkernel.sampling.rng import uniforms
from torch import Tensor

NEG_INF = float("-inf")


def ordered_keys(x: Tensor) -> Tensor:  # float32 [rows, vocab] -> int64 [rows, vocab] in [0, 2^32)
    """Integers in the order of the floats (-0 and +0 share one key, as they compare equal)."""
    bits = torch.where(x == 0.0, 0.0, x).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 1 << 31, 0xFFFFFFFF - bits, bits + (1 << 31))


def scale(
    logits: Tensor,  # [rows, vocab], any float dtype
    inv_temperature: Tensor,  # float32 [rows]; 0 for greedy rows
) -> tuple[Tensor, Tensor]:  # float32 [rows, vocab], int32 [rows]
    """x = logits * (1 / T) for sampled rows (the logits themselves for greedy rows), and each row's status."""
    factor = torch.where(inv_temperature == 0, 1.0, inv_temperature)
    x = logits.to(torch.float32) * factor.unsqueeze(1)
    nonfinite = (x.isnan() | (x == float("inf"))).any(dim=-1)
    empty = (x == NEG_INF).all(dim=-1)
    status = torch.where(
        nonfinite, int(SampleStatus.NONFINITE), torch.where(empty, int(SampleStatus.NO_TOKEN), 0)
    )
    return x, status.to(torch.int32)


def _top_p_threshold(
    keys: Tensor,  # int64 [rows, vocab]: ordered_keys(x)
    mass: Tensor,  # int64 [rows, vocab]: 0 outside the kept set
    threshold: Tensor,  # float64 [rows]: top_p * total kept mass
) -> Tensor:  # int64 [rows]
    """The smallest key whose strictly-greater kept mass is below `threshold`, by bisection over [0, 2^32)."""
    rows = keys.shape[0]
    lo = torch.zeros(rows, dtype=torch.int64, device=keys.device)
    hi = torch.full_like(lo, 0xFFFFFFFF)  # no key exceeds it: its mass above, 0, is below any threshold > 0
    for _ in range(32):
        mid = (lo + hi) // 2
        above = torch.where(keys > mid.unsqueeze(1), mass, 0).sum(dim=-1)
        ok = above.to(torch.float64) < threshold
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid + 1)
    return lo


def truncation_mask(
    x: Tensor,  # float32 [rows, vocab]: logits * (1 / T), rows without NaN or +inf
    top_k: Tensor,  # int64 [rows]
    top_p: Tensor,  # float32 [rows]
    min_p: Tensor,  # float32 [rows]
) -> Tensor:  # bool [rows, vocab]
    """The tokens min_p, then top_k, then top_p keep (see the module docstring)."""
    vocab = x.shape[1]
    e = exp32(x - x.amax(dim=-1, keepdim=True))
    keep = (x > NEG_INF) & (e >= min_p.unsqueeze(1))
    k_rows = (top_k > 0) & (top_k < vocab)
    if bool(k_rows.any()):
        k_max = int(top_k[k_rows].max())
        values = torch.where(keep, x, NEG_INF).topk(k_max, dim=-1).values  # [rows, k_max], descending
        kth = values.gather(1, (top_k.clamp(1, k_max) - 1).unsqueeze(1))
        keep &= ~k_rows.unsqueeze(1) | (x >= kth)
    p_rows = top_p < 1.0
    if bool(p_rows.any()):
        mass = torch.where(keep, (e * 2.0**MASS_BITS).to(torch.int64), 0)
        threshold = top_p.to(torch.float64) * mass.sum(dim=-1).to(torch.float64)
        keys = ordered_keys(x)
        cut = _top_p_threshold(keys, mass, threshold)
        keep &= ~p_rows.unsqueeze(1) | (keys >= cut.unsqueeze(1))
    return keep


def gumbel_scores(
    x: Tensor,  # float32 [rows, vocab]
    keys: Tensor,  # int64 [rows]
) -> Tensor:  # float32 [rows, vocab]
    """x - log(-log(u)): the argmax over a kept set draws token i with probability softmax(x) over that set."""
    return x - log32(-log32(uniforms(keys, x.shape[1])))


def run(
    logits: Tensor,  # [rows, vocab], float32 / bfloat16 / float16
    inv_temperature: Tensor,  # float32 [rows]; 0: greedy
    top_k: Tensor,  # int64 [rows]; 0: disabled
    top_p: Tensor,  # float32 [rows]; 1: disabled
    min_p: Tensor,  # float32 [rows]; 0: disabled
    keys: Tensor,  # int64 [rows]
    *,
    with_mask: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:  # int64 [rows], int32 [rows], bool [rows, vocab] or None
    """One token and one status per row (argmax for greedy rows, a Gumbel-max draw over the kept set for the
    others) and, with_mask, the tokens each row can draw (the argmax alone for greedy rows, none for bad rows)."""
    x, status = scale(logits, inv_temperature)
    tokens = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    mask = torch.zeros(x.shape, dtype=torch.bool, device=x.device) if with_mask else None
    good = status == 0
    greedy = (good & (inv_temperature == 0)).nonzero().squeeze(1)
    sampled = (good & (inv_temperature != 0)).nonzero().squeeze(1)
    tokens[greedy] = x[greedy].argmax(dim=-1)
    if mask is not None:
        mask[greedy, tokens[greedy]] = True
    if sampled.numel():
        xs = x[sampled]
        keep = truncation_mask(xs, top_k[sampled], top_p[sampled], min_p[sampled])
        scores = torch.where(keep, gumbel_scores(xs, keys[sampled]), NEG_INF)
        tokens[sampled] = scores.argmax(dim=-1)
        if mask is not None:
            mask[sampled] = keep
    return tokens, status, mask
