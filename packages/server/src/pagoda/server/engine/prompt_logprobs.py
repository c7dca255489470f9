"""Prompt logprobs and pooling: which chunks want their prompt positions' hidden states; scoring them over the LM
head, or handing them to the pooling request."""

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
    """Chunk request id -> the end of the positions whose hidden states it wants: prompt length - 1 for prompt
    logprobs (the last position predicts the first output), `hidden_states_end` for a pooling request."""
    ends: dict[str, int] = {}
    for chunk in scheduled.scheduled:
        owner = owners[chunk.request_id]
        if owner.prompt_logprobs_k is not None:
            ends[chunk.request_id] = len(owner.prompt_token_ids) - 1
        elif (end := owner.hidden_states_end) is not None:
            ends[chunk.request_id] = end
    return ends


def add_prompt_logprobs(
    executor: Executor, owners: Mapping[str, EngineRequest], prompt_hidden: Mapping[str, PromptHidden]
) -> None:
    """Score each chunk's prompt positions and hand the logprobs to its request; a request that asked for the
    hidden states themselves (pooling) takes them."""
    for request_id, rows in prompt_hidden.items():
        owner = owners[request_id]
        if owner.prompt_logprobs_k is None:
            owner.add_hidden_states(rows.start, rows.hidden)
        else:
            score_prompt(executor, owner, rows.start, rows.hidden)


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
