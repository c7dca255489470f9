"""Logprobs of the sampled tokens and their top alternatives, from the raw model logits (vLLM's default)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pagoda.server.sampling.records import TokenLogprobs
from torch import Tensor


def compute_logprobs(
    logits: Tensor,  # [num_rows, vocab] raw model logits (any float dtype), before temperature and penalties
    token_ids: Tensor,  # [num_rows] int64, the sampled tokens
    num_logprobs: Sequence[int | None],  # per row: top alternatives wanted, None for no logprobs at all
) -> list[TokenLogprobs | None]:
    """Each requesting row's sampled logprob, 1-based rank and top-k; None for rows that did not ask."""
    wanted = [i for i, k in enumerate(num_logprobs) if k is not None]
    result: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    if not wanted:
        return result
    index = torch.tensor(wanted, dtype=torch.long, device=logits.device)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)  # [num_wanted, vocab] float32
    chosen = logprobs.gather(1, token_ids[index].unsqueeze(1))  # [num_wanted, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    max_k = min(max(num_logprobs[i] or 0 for i in wanted), logits.shape[1])
    top_values, top_ids = logprobs.topk(max_k, dim=-1)  # [num_wanted, max_k], most likely first
    # One transfer per tensor, then plain Python slicing per row.
    chosen_list = chosen.squeeze(1).tolist()
    rank_list = ranks.tolist()
    value_rows = top_values.tolist()
    id_rows = top_ids.tolist()
    for j, i in enumerate(wanted):
        k = num_logprobs[i] or 0
        result[i] = TokenLogprobs(
            logprob=chosen_list[j],
            rank=rank_list[j],
            top_token_ids=id_rows[j][:k],
            top_logprobs=value_rows[j][:k],
        )
    return result
