"""Logits processing the engine applies before the Sampler: allowed_token_ids, bad_words, then logit_bias.

vLLM v1's order and semantics. The edits run on a float32 copy, so the raw logits stay intact for the logprobs
users get (vLLM's default: logprobs of the raw model distribution, before any processing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from pagoda.server.sampling.penalties import float_copy, mask_tokens
from torch import Tensor
from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class LogitsEdits:
    """One row's edits: a bias per token id, the only ids it may sample, and the bad words' token sequences."""

    logit_bias: Mapping[int, float] | None
    allowed_token_ids: Sequence[int] | None
    bad_words_token_ids: Sequence[Sequence[int]]
    # Generated so far: a multi-token bad word bans its last token after a match.
    output_token_ids: Sequence[int]

    @property
    def empty(self) -> bool:
        """True when the row's logits stay as they are."""
        return not (self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids)


def tokenize_bad_words(
    tokenizer: PreTrainedTokenizerBase, bad_words: Sequence[str]
) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids as written, and with a leading space (vLLM's rule, so that a word is banned both
    at the start of the text and after a space); the spaced form only where it is a distinct token sequence of
    the same length."""
    sequences: list[tuple[int, ...]] = []
    for word in bad_words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if plain:
            sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            sequences.append(spaced)
    return tuple(sequences)


def _banned_by_bad_words(edits: LogitsEdits) -> list[int]:
    """The last token of every bad word whose preceding tokens end the output (single tokens: always)."""
    banned: list[int] = []
    past = edits.output_token_ids
    for word in edits.bad_words_token_ids:
        prefix = len(word) - 1
        if prefix > len(past):
            continue
        if prefix == 0 or list(past[-prefix:]) == list(word[:prefix]):
            banned.append(word[-1])
    return banned


def _allow_only(
    logits: Tensor,  # [num_rows, vocab], edited in place
    row_indices: Sequence[int],
    allowed: Sequence[Sequence[int]],  # per listed row: the ids it may sample
) -> None:
    """Set every logit but the allowed ids' to -inf."""
    device = logits.device
    keep = torch.zeros(len(row_indices), logits.shape[1], dtype=torch.bool, device=device)
    local = [j for j, ids in enumerate(allowed) for _ in ids]
    tokens = [t for ids in allowed for t in ids]
    keep[
        torch.tensor(local, dtype=torch.long, device=device),
        torch.tensor(tokens, dtype=torch.long, device=device),
    ] = True
    index = torch.tensor(row_indices, dtype=torch.long, device=device)
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))


def _add_bias(
    logits: Tensor,  # [num_rows, vocab], edited in place
    row_indices: Sequence[int],
    biases: Sequence[Mapping[int, float]],  # per listed row
) -> None:
    """Add each row's bias to its listed token ids (the ids of one row are distinct: one put)."""
    device = logits.device
    rows = [i for i, bias in zip(row_indices, biases, strict=True) for _ in bias]
    tokens = [t for bias in biases for t in bias]
    values = [v for bias in biases for v in bias.values()]
    index = (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(tokens, dtype=torch.long, device=device),
    )
    logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def apply_logits_processors(
    logits: Tensor,  # [num_rows, vocab] raw model logits
    rows: Sequence[LogitsEdits],
) -> Tensor:  # [num_rows, vocab]: logits itself when no row needs an edit, else an edited float32 copy
    """allowed_token_ids, then bad_words, then logit_bias, on the rows that ask for them."""
    if all(row.empty for row in rows):
        return logits
    edited = float_copy(logits)  # never edit the caller's tensor: the sampler takes logprobs from it
    allowed = [i for i, row in enumerate(rows) if row.allowed_token_ids is not None]
    if allowed:
        _allow_only(edited, allowed, [rows[i].allowed_token_ids or () for i in allowed])
    banned = {i: _banned_by_bad_words(row) for i, row in enumerate(rows) if row.bad_words_token_ids}
    banned_rows = [i for i, ids in banned.items() if ids]
    if banned_rows:
        mask_tokens(edited, banned_rows, [banned[i] for i in banned_rows])
    biased = [i for i, row in enumerate(rows) if row.logit_bias]
    if biased:
        _add_bias(edited, biased, [rows[i].logit_bias or {} for i in biased])
    return edited
