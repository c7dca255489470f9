"""Prompt logprobs and pooling: which chunks want their prompt positions' hidden states; scoring them over the LM
head (`ScoresPrompt`), or handing them to the request that takes them (`TakesHiddenStates`: pooling)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from pagoda.scheduler import SchedulerOutput
from pagoda.server.engine.executor import Executor
from pagoda.server.engine.model_runner import PromptHidden
from pagoda.server.engine.owners import RequestOwners
from pagoda.server.request_contract import ScoresPrompt
from pagoda.server.sampling.logprobs import compute_logprobs

# Prompt logprobs run the LM head over this many prompt positions at a time: [rows, vocab] float32 logits are
# 1 GiB per 1,024 rows of a 262k vocabulary.
_PROMPT_LOGITS_SLICE = 256


def prompt_lens(scheduled: SchedulerOutput, owners: RequestOwners) -> dict[str, int]:
    """Chunk request id -> the end of the positions whose hidden states it wants: prompt length - 1 for prompt
    logprobs (the last position predicts the first output), `hidden_states_end` for a pooling request."""
    ends: dict[str, int] = {}
    scorers, takers = owners.prompt_scorers, owners.hidden_takers
    for chunk in scheduled.scheduled:
        request_id = chunk.request_id
        scorer = scorers.get(request_id)
        if scorer is not None and scorer.prompt_logprobs_k is not None:
            ends[request_id] = len(scorer.prompt_token_ids) - 1
        elif (taker := takers.get(request_id)) is not None and (end := taker.hidden_states_end) is not None:
            ends[request_id] = end
    return ends


def add_prompt_logprobs(
    executor: Executor, owners: RequestOwners, prompt_hidden: Mapping[str, PromptHidden]
) -> None:
    """Score each chunk's prompt positions and hand the logprobs to its request; a request that asked for the
    hidden states themselves (pooling) takes them."""
    for request_id, rows in prompt_hidden.items():
        scorer = owners.prompt_scorers.get(request_id)
        if scorer is not None and scorer.prompt_logprobs_k is not None:
            score_prompt(executor, scorer, rows.start, rows.hidden)
        else:
            owners.hidden_takers[request_id].add_hidden_states(rows.start, rows.hidden)


def score_prompt(
    executor: Executor,
    owner: ScoresPrompt,
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
