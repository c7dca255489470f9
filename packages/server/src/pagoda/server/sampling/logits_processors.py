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


class PreparedEdits:
    """One request's edits in the form each step applies, built once per request and shared by its samples.

    allowed_token_ids and the one-token bad words become one cached boolean mask of blocked ids, the bias one
    cached pair of (ids, values) tensors, and the multi-token bad words an index by their next-to-last token, so
    a step checks only the words the last output token can complete. Nothing here grows with the step count.
    """

    __slots__ = ("_bias", "_bias_tensors", "_blocked", "_by_previous", "allowed_token_ids", "single_bans")

    def __init__(
        self,
        logit_bias: Mapping[int, float] | None,
        allowed_token_ids: Sequence[int] | None,
        bad_words_token_ids: Sequence[Sequence[int]],
    ) -> None:
        """Index the request's edits (tensors are built on first use, for the logits' vocabulary and device)."""
        self._bias = dict(logit_bias or {})
        self.allowed_token_ids = None if allowed_token_ids is None else tuple(allowed_token_ids)
        self.single_bans = tuple(sorted({word[0] for word in bad_words_token_ids if len(word) == 1}))
        by_previous: dict[int, list[tuple[int, ...]]] = {}
        for word in bad_words_token_ids:
            if len(word) > 1:
                by_previous.setdefault(word[-2], []).append(tuple(word))
        self._by_previous = by_previous
        self._blocked: dict[tuple[int, torch.device], Tensor | None] = {}
        self._bias_tensors: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}

    @property
    def empty(self) -> bool:
        """True when nothing is edited."""
        return not (self._bias or self.allowed_token_ids is not None or self.single_bans or self._by_previous)

    @property
    def has_bias(self) -> bool:
        """True when some token has a bias."""
        return bool(self._bias)

    def blocked(self, vocab_size: int, device: torch.device) -> Tensor | None:  # bool [vocab_size]
        """The ids this request may never sample (outside allowed_token_ids, one-token bad words); cached."""
        key = (vocab_size, device)
        if key not in self._blocked:
            mask = None
            if self.allowed_token_ids is not None:
                mask = torch.ones(vocab_size, dtype=torch.bool, device=device)
                mask[torch.tensor(self.allowed_token_ids, dtype=torch.long, device=device)] = False
            if self.single_bans:
                if mask is None:
                    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
                mask[torch.tensor(self.single_bans, dtype=torch.long, device=device)] = True
            self._blocked[key] = mask
        return self._blocked[key]

    def banned_after(self, output_token_ids: Sequence[int]) -> list[int]:
        """The last token of every multi-token bad word whose other tokens end the output."""
        if not output_token_ids:
            return []
        banned: list[int] = []
        for word in self._by_previous.get(output_token_ids[-1], ()):
            prefix = len(word) - 1
            if prefix <= len(output_token_ids) and tuple(output_token_ids[-prefix:]) == word[:prefix]:
                banned.append(word[-1])
        return banned

    def bias(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:  # [k] ids, [k] values
        """The biased ids and their biases (the ids of one request are distinct); cached."""
        key = (device, dtype)
        if key not in self._bias_tensors:
            ids = torch.tensor(list(self._bias), dtype=torch.long, device=device)
            values = torch.tensor(list(self._bias.values()), dtype=dtype, device=device)
            self._bias_tensors[key] = (ids, values)
        return self._bias_tensors[key]


@dataclass(frozen=True, slots=True)
class LogitsEdits:
    """One row's edits: a bias per token id, the only ids it may sample, and the bad words' token sequences."""

    logit_bias: Mapping[int, float] | None
    allowed_token_ids: Sequence[int] | None
    bad_words_token_ids: Sequence[Sequence[int]]
    # Generated so far: a multi-token bad word bans its last token after a match.
    output_token_ids: Sequence[int]
    # The same edits prepared once by the request (engine/requests.py); None: prepared for this call only.
    prepared: PreparedEdits | None = None

    @property
    def empty(self) -> bool:
        """True when the row's logits stay as they are."""
        return not (self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids)

    def prepare(self) -> PreparedEdits:
        """The request's prepared edits."""
        if self.prepared is not None:
            return self.prepared
        return PreparedEdits(self.logit_bias, self.allowed_token_ids, self.bad_words_token_ids)


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


def apply_logits_processors(
    logits: Tensor,  # [num_rows, vocab] raw model logits
    rows: Sequence[LogitsEdits],
) -> Tensor:  # [num_rows, vocab]: logits itself when no row needs an edit, else an edited float32 copy
    """allowed_token_ids and bad words, then logit_bias, on the rows that ask for them (masking to -inf commutes
    with itself, so the blocked ids of both lists go in one masked fill)."""
    if all(row.empty for row in rows):
        return logits
    edited = float_copy(logits)  # never edit the caller's tensor: the sampler takes logprobs from it
    vocab_size, device = edited.shape[1], edited.device
    prepared = [row.prepare() for row in rows]
    blocked = [
        (i, mask) for i, p in enumerate(prepared) if (mask := p.blocked(vocab_size, device)) is not None
    ]
    if blocked:
        index = torch.tensor([i for i, _ in blocked], dtype=torch.long, device=device)
        masks = torch.stack([mask for _, mask in blocked])  # [num_blocked_rows, vocab]
        edited[index] = edited[index].masked_fill(masks, float("-inf"))
    banned = {
        i: p.banned_after(row.output_token_ids) for i, (p, row) in enumerate(zip(prepared, rows, strict=True))
    }
    banned_rows = [i for i, ids in banned.items() if ids]
    if banned_rows:
        mask_tokens(edited, banned_rows, [banned[i] for i in banned_rows])
    biased = [i for i, p in enumerate(prepared) if p.has_bias]
    if biased:
        pairs = [prepared[i].bias(device, edited.dtype) for i in biased]
        counts = torch.tensor([len(ids) for ids, _ in pairs], dtype=torch.long, device=device)
        row_index = torch.repeat_interleave(torch.tensor(biased, dtype=torch.long, device=device), counts)
        token_index = torch.cat([ids for ids, _ in pairs])
        values = torch.cat([v for _, v in pairs])
        edited.index_put_((row_index, token_index), values, accumulate=True)
    return edited
