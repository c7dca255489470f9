"""Logit edits that depend on a row's token history: min_tokens stop masking and the three penalties.

`apply_history` runs the stages some row needs on a float32 copy of the logits; the stage functions edit `logits` in
place for a subset of its rows. A history becomes flat (row, token) index pairs, applied with one gather and
one index_put and no sort or dedup: a token seen twice writes the same value twice, and counts come from an
accumulating put. So the cost grows with the number of history tokens, not with rows x vocab (a dense
[rows, vocab] count tensor is 1 GiB at 1,024 rows of a 262k vocab).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch
from pagoda.server.sampling.records import SamplingRow
from torch import Tensor


def _flat_pairs(
    row_indices: Sequence[int], token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """(local row, logits row, token id) of every history token: the index triple for gathers and puts."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.long)
    local = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}) to index the logits")
    rows = torch.tensor(row_indices, dtype=torch.long)[local]
    return local.to(device), rows.to(device), tokens.to(device)


def float_copy(
    logits: Tensor,  # [num_rows, vocab]
) -> Tensor:  # [num_rows, vocab] float32, never the caller's tensor
    """A float32 copy to edit in place (the caller's logits stay intact for the logprobs users get)."""
    edited = logits.float()
    return logits.clone() if edited is logits else edited


def mask_tokens(
    logits: Tensor,  # [num_rows, vocab], edited in place
    row_indices: Sequence[int],
    token_ids: Sequence[Sequence[int]],  # per listed row: the ids to forbid
) -> None:
    """Set the listed tokens' logits to -inf (min_tokens keeps stop tokens from being sampled)."""
    _, rows, tokens = _flat_pairs(row_indices, token_ids, logits.shape[1], logits.device)
    logits[rows, tokens] = float("-inf")


def apply_repetition_penalty(
    logits: Tensor,  # [num_rows, vocab], edited in place
    row_indices: Sequence[int],
    token_ids: Sequence[Sequence[int]],  # per listed row: prompt and output tokens
    penalties: Sequence[float],  # per listed row, > 0
) -> None:
    """vLLM's repetition penalty: every token seen in prompt or output has a positive logit divided by the
    penalty and a negative one multiplied by it (once, however often it occurs)."""
    local, rows, tokens = _flat_pairs(row_indices, token_ids, logits.shape[1], logits.device)
    penalty = torch.tensor(penalties, dtype=logits.dtype, device=logits.device)[local]
    values = logits[rows, tokens]  # gathered before the put, so repeats compute and write the same value
    logits[rows, tokens] = torch.where(values > 0, values / penalty, values * penalty)


def apply_frequency_presence_penalties(
    logits: Tensor,  # [num_rows, vocab], edited in place
    row_indices: Sequence[int],
    output_token_ids: Sequence[Sequence[int]],  # per listed row: generated tokens only
    frequency_penalties: Sequence[float],  # per listed row
    presence_penalties: Sequence[float],  # per listed row
) -> None:
    """OpenAI's penalties on generated tokens: presence once per distinct token, frequency per occurrence."""
    device = logits.device
    local, rows, tokens = _flat_pairs(row_indices, output_token_ids, logits.shape[1], device)
    presence = torch.tensor(presence_penalties, dtype=logits.dtype, device=device)[local]
    frequency = torch.tensor(frequency_penalties, dtype=logits.dtype, device=device)[local]
    logits[rows, tokens] = logits[rows, tokens] - presence  # repeats write the same value: applied once
    logits.index_put_((rows, tokens), -frequency, accumulate=True)  # applied per occurrence


def _history_rows(rows: Sequence[SamplingRow]) -> tuple[list[int], list[int], list[int]]:
    """Rows needing the repetition penalty, the frequency/presence penalties, and min_tokens masking."""
    repetition = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    additive = [
        i
        for i, row in enumerate(rows)
        if row.output_token_ids and (row.params.frequency_penalty or row.params.presence_penalty)
    ]
    blocked = [
        i
        for i, row in enumerate(rows)
        if row.stop_token_ids and len(row.output_token_ids) < row.params.min_tokens
    ]
    return repetition, additive, blocked


def needs_history(rows: Sequence[SamplingRow]) -> bool:
    """Whether `apply_history` would edit any row's logits."""
    return any(_history_rows(rows))


def apply_history(
    logits: Tensor,  # [num_rows, vocab]
    rows: Sequence[SamplingRow],
) -> Tensor:  # [num_rows, vocab]: logits itself when no row needs an edit, else an edited float32 copy
    """The logits after repetition, frequency and presence penalties and min_tokens stop masking (edited in
    float32, so that a penalty on bfloat16 logits is not rounded to bfloat16)."""
    repetition, additive, blocked = _history_rows(rows)
    if not (repetition or additive or blocked):
        return logits
    edited = float_copy(logits)
    if repetition:
        apply_repetition_penalty(
            edited,
            repetition,
            [[*rows[i].prompt_token_ids, *rows[i].output_token_ids] for i in repetition],
            [rows[i].params.repetition_penalty for i in repetition],
        )
    if additive:
        apply_frequency_presence_penalties(
            edited,
            additive,
            [rows[i].output_token_ids for i in additive],
            [rows[i].params.frequency_penalty for i in additive],
            [rows[i].params.presence_penalty for i in additive],
        )
    if blocked:
        mask_tokens(edited, blocked, [rows[i].stop_token_ids for i in blocked])
    return edited
