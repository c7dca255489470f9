"""Distribution truncation after temperature: min_p, top_k and top_p (nucleus), vectorized across rows.

Every function edits `logits` in place, setting dropped tokens to -inf; ties at a threshold are kept.
Neither top_k nor top_p sorts the whole vocabulary in the common case: a partial top-k finds the threshold
(a full sort of a 262k vocabulary costs a CPU tens of milliseconds per row).
"""

from __future__ import annotations

import torch
from torch import Tensor

# top_p looks for the nucleus among this many most likely tokens first; rows whose candidates hold less than
# top_p of the mass (very flat distributions) fall back to a full sort.
TOP_P_CANDIDATES = 1024


def apply_min_p(
    logits: Tensor,  # [num_rows, vocab], edited in place
    min_p: Tensor,  # [num_rows], in [0, 1]
) -> None:
    """Drop tokens whose probability is below min_p times the most likely token's probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k(
    logits: Tensor,  # [num_rows, vocab], edited in place
    top_k: Tensor,  # [num_rows] int64, in [1, vocab]
    max_top_k: int,  # top_k.max(), passed in so that no device sync is needed
) -> None:
    """Keep each row's top_k most likely tokens."""
    values = logits.topk(max_top_k, dim=-1).values  # [num_rows, max_top_k], descending
    kth = values.gather(1, (top_k - 1).unsqueeze(1))  # the same value whatever max_top_k is
    logits.masked_fill_(logits < kth, float("-inf"))


def _nucleus_drop(
    probs: Tensor,  # [num_rows, n] descending
    cumulative: Tensor,  # [num_rows, n] probs.cumsum(-1)
    order: Tensor,  # [num_rows, n] their token ids
    top_p: Tensor,  # [num_rows]
    vocab: int,
) -> Tensor:  # [num_rows, vocab] bool, True where dropped (every token outside `order` too)
    """A token stays when the mass of the tokens more likely than it is below top_p (so the first stays)."""
    keep = cumulative - probs < top_p.unsqueeze(1)
    drop = torch.ones(probs.shape[0], vocab, dtype=torch.bool, device=probs.device)
    return drop.scatter_(1, order, ~keep)


def apply_top_p(
    logits: Tensor,  # [num_rows, vocab], edited in place
    top_p: Tensor,  # [num_rows], in (0, 1]
    candidates: int = TOP_P_CANDIDATES,
) -> None:
    """Keep the smallest set of most likely tokens whose probability mass reaches top_p.

    Each row takes the candidate path or the full sort by its own values alone, so a seeded row samples the
    same way whatever else is in the batch.
    """
    vocab = logits.shape[1]
    probs = logits.softmax(dim=-1)
    values, order = probs.topk(min(candidates, vocab), dim=-1)  # descending
    cumulative = values.cumsum(dim=-1)
    drop = _nucleus_drop(values, cumulative, order, top_p, vocab)
    # Dropping every token outside the candidates is right only if they already hold top_p of the mass.
    flat = (cumulative[:, -1] < top_p).nonzero().squeeze(1)
    if flat.numel():
        full_values, full_order = probs[flat].sort(dim=-1, descending=True)
        drop[flat] = _nucleus_drop(full_values, full_values.cumsum(dim=-1), full_order, top_p[flat], vocab)
    logits.masked_fill_(drop, float("-inf"))
