"""Distribution truncation after temperature: min_p, top_k and top_p (nucleus), vectorized across rows.

Every function edits `logits` in place, setting dropped tokens to -inf; ties at a threshold are kept.
"""

from __future__ import annotations

from torch import Tensor


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
    """Keep each row's top_k most likely tokens (a partial top-k, cheaper than a full sort for small k)."""
    values = logits.topk(max_top_k, dim=-1).values  # [num_rows, max_top_k], descending
    kth = values.gather(1, (top_k - 1).unsqueeze(1))
    logits.masked_fill_(logits < kth, float("-inf"))


def apply_top_k_top_p(
    logits: Tensor,  # [num_rows, vocab], edited in place
    top_k: Tensor | None,  # [num_rows] int64 in [1, vocab] (vocab: no limit), or None for no row
    top_p: Tensor,  # [num_rows], in (0, 1] (1: no limit)
) -> None:
    """Apply top_k then top_p with one ascending sort; top_p keeps the smallest set holding mass >= p."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending, so the most likely token is last
    if top_k is not None:
        # The same k-th largest value that apply_top_k finds, so both paths keep identical sets.
        kth = sorted_logits.gather(1, (vocab - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop &= (top_p < 1.0).unsqueeze(1)  # rows without top_p stay exactly as top_k left them
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, order, sorted_logits)
