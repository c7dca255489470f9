"""Logprobs for the rows that ask: of the raw model distribution (log_softmax of the logits before temperature,
penalties and truncation), vLLM's default `raw_logprobs` mode. Shared by every backend; the top-N is a partial
selection (torch.topk), and only the asking rows are touched."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pagoda.pagedkernel.sampling.params import Logprobs
from torch import Tensor


def compute_logprobs(
    logits: Tensor,  # [rows, vocab] raw model logits
    token_ids: Tensor,  # int64 [rows], the sampled tokens
    num_logprobs: Sequence[int | None],  # per row: top-N wanted (0: the sampled token only), None: nothing
) -> Logprobs | None:
    """The sampled token's logprob and rank and the top-N of every asking row; None when no row asks."""
    if len(num_logprobs) != logits.shape[0]:
        raise ValueError(f"num_logprobs has {len(num_logprobs)} entries for {logits.shape[0]} rows")
    wanted = [i for i, k in enumerate(num_logprobs) if k is not None]
    if not wanted:
        return None
    top = tuple(min(num_logprobs[i] or 0, logits.shape[1]) for i in wanted)
    rows = torch.tensor(wanted, dtype=torch.int64, device=logits.device)
    logprobs = torch.log_softmax(logits[rows].to(torch.float32), dim=-1)  # [n, vocab]
    sampled = logprobs.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1)  # [n]
    rank = (logprobs > sampled.unsqueeze(1)).sum(dim=-1) + 1
    top_logprobs, top_token_ids = logprobs.topk(max(top), dim=-1)  # [n, max(top)], most likely first
    return Logprobs(
        rows=rows,
        sampled=sampled,
        rank=rank,
        top_token_ids=top_token_ids,
        top_logprobs=top_logprobs,
        top=top,
    )
