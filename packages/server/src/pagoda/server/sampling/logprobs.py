"""Logprobs of the sampled tokens and their top alternatives, from the raw model logits (vLLM's default).

The computation is the sampling op's (`pagoda.pagedkernel.sampling.compute_logprobs`); this module turns its tensors
into the engine's per-row records.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.pagedkernel.sampling.logprobs import compute_logprobs as compute_logprob_tensors
from pagoda.server.sampling.records import TokenLogprobs
from torch import Tensor


def compute_logprobs(
    logits: Tensor,  # [num_rows, vocab] raw model logits (any float dtype), before temperature and penalties
    token_ids: Tensor,  # [num_rows] int64, the sampled tokens
    num_logprobs: Sequence[int | None],  # per row: top alternatives wanted, None for no logprobs at all
) -> list[TokenLogprobs | None]:
    """Each requesting row's sampled logprob, 1-based rank and top-k; None for rows that did not ask."""
    result: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    computed = compute_logprob_tensors(logits, token_ids, num_logprobs)
    if computed is None:
        return result
    # One transfer per tensor, then plain Python slicing per row.
    rows = computed.rows.tolist()
    sampled = computed.sampled.tolist()
    ranks = computed.rank.tolist()
    id_rows = computed.top_token_ids.tolist()
    value_rows = computed.top_logprobs.tolist()
    for j, (row, k) in enumerate(zip(rows, computed.top, strict=True)):
        result[row] = TokenLogprobs(
            logprob=sampled[j],
            rank=ranks[j],
            top_token_ids=id_rows[j][:k],
            top_logprobs=value_rows[j][:k],
        )
    return result
