"""Prompt logprobs: which chunks want their prompt positions' hidden states, and scoring them over the LM head."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from pagoda.scheduler import SchedulerOutput
from pagoda.server.engine.engine_request import EngineRequest
from pagoda.server.engine.executor import Executor
from pagoda.server.engine.model_runner import PromptHidden
from pagoda.server.sampling.logprobs import compute_logprobs

# Prompt logprobs run the LM head over this many prompt positions at a time: [rows, vocab] float32 logits are
# 1 GiB per 1,024 rows of a 262k vocabulary.
_PROMPT_LOGITS_SLICE = 256


def prompt_lens(scheduled: SchedulerOutput, owners: Mapping[str, EngineRequest]) -> dict[str, int]:
    """Chunk request id -> prompt length, for the chunks whose request still wants prompt logprobs."""
    return {
        chunk.request_id: len(owner.prompt_token_ids)
        for chunk in scheduled.scheduled
        if (owner := owners[chunk.request_id]).prompt_logprobs_k is not None
    }


def add_prompt_logprobs(
    executor: Executor, owners: Mapping[str, EngineRequest], prompt_hidden: Mapping[str, PromptHidden]
) -> None:
    """Score each chunk's prompt positions and hand the logprobs to its request."""
    for request_id, rows in prompt_hidden.items():
        score_prompt(executor, owners[request_id], rows.start, rows.hidden)


def score_prompt(
    executor: Executor,
    owner: EngineRequest,
    start: int,
    hidden: torch.Tensor,  # [num_positions, hidden_size]: positions start, start + 1, ...
) -> None:
    """Score the prompt tokens after these positions, from the raw logits, a slice at a time."""
    k = owner.prompt_logprobs_k or 0
    for lo in range(0, hidden.shape[0], _PROMPT_LOGITS_SLICE):
        part = hidden[lo : lo + _PROMPT_LOGITS_SLICE]
        logits = executor.compute_logits(part).float()
        first = start + lo + 1
        targets = torch.tensor(
            owner.prompt_token_ids[first : first + part.shape[0]], dtype=torch.long, device=logits.device
        )
        scored = compute_logprobs(logits, targets, [k] * part.shape[0])
        owner.add_prompt_logprobs(start + lo, [lp for lp in scored if lp is not None])
