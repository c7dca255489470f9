"""Verification of draft tokens in one forward pass: one row per drafted position, then the accepted run.

A chunk with k drafts gets k + 1 logits rows (the runner computes all). Row j is drawn exactly as a
non-speculative step would draw that position had drafts 0..j-1 been sampled: its history (penalties,
min_tokens, bad words) includes them and its RNG key is the one of that output position. A draft is accepted
while it equals the token drawn for its position, and the run ends with the first drawn token that differs (or
the token after the last draft). For greedy rows that is "accept while the draft is the argmax": the output is
token for token the non-speculative one. For sampled rows it is rejection sampling with a point-mass draft:
the draft d is kept with probability p(d), and otherwise the drawn token is distributed as p with d's mass
removed and renormalised, so every output token has exactly the target's distribution; and since the draw of
a position depends only on its row and key, a seeded request's tokens are the same whatever the batch and
whatever was drafted.

A draft model's drafts are not point masses: a sampled row's draft d was drawn from the draft's distribution
q, and `rejection_sample` keeps it with probability min(1, p(d) / q(d)), else draws the position's token from
the normalised residual max(0, p - q) (Leviathan et al.'s rule; the output is again exactly p). Its uniforms
come from the row's own key, salted, so a seeded request stays deterministic. Greedy rows (q unused) keep
"accept while the draft is the argmax".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pagoda.pagedkernel.sampling.rng import mix64_int, uniforms
from pagoda.server.request_contract import DrawSpec
from torch import Tensor

# Salts a row's key into the keys of its acceptance test and of its residual draw.
_ACCEPT_SALT, _RESIDUAL_SALT = 0x2545F4914F6CDD1D, 0x7F4A7C159E3779B9


def draft_row_specs(spec: DrawSpec, drafts: Sequence[int]) -> list[DrawSpec]:
    """The len(drafts) + 1 row specs of a drafted chunk: row j sees drafts[:j] as already generated."""
    if spec.matcher is not None:
        raise ValueError("a constrained (grammar) row cannot be drafted")
    rows = [spec]
    for j in range(1, len(drafts) + 1):
        history = [*spec.row.output_token_ids, *drafts[:j]]
        rows.append(
            dataclasses.replace(
                spec,
                row=dataclasses.replace(spec.row, output_token_ids=history),
                edits=dataclasses.replace(spec.edits, output_token_ids=history),
            )
        )
    return rows


def num_accepted(drafts: Sequence[int], drawn: Sequence[int]) -> int:
    """Drafts accepted: the length of the run where each equals the token drawn for its position."""
    accepted = 0
    for draft, token in zip(drafts, drawn, strict=False):
        if draft != token:
            break
        accepted += 1
    return accepted


@dataclass(frozen=True, slots=True)
class DraftGroup:
    """The rows of one drafted chunk in the step's row order: the first row's index and the drafts."""

    first_row: int
    seq_id: str
    drafts: tuple[int, ...]
    probs: Tensor | None = None  # float32 [len(drafts), vocab]: the draft model's q (None: point masses)


def _uniforms(key: int, salt: int, vocab: int, device: torch.device) -> Tensor:  # float32 [vocab]
    """The counter-based uniforms of a salted row key (the sampling op's generator)."""
    mixed = mix64_int(key ^ salt)
    signed = mixed - (1 << 64) if mixed >= 1 << 63 else mixed  # the int64 of the same bits
    return uniforms(torch.tensor([signed], dtype=torch.int64, device=device), vocab)[0]


def rejection_sample(
    p: Tensor,  # float32 [k + 1, vocab]: the target's distribution at each row (after every sampling param)
    q: Tensor,  # float32 [k, vocab]: the draft's distribution at each drafted position
    drafts: Sequence[int],
    keys: Sequence[int],  # the k + 1 rows' RNG keys
    drawn: Sequence[
        int
    ],  # the k + 1 tokens the sampler drew from p (the last one follows an all-accepted run)
) -> list[int]:
    """The rows' tokens: each draft while accepted (probability min(1, p/q)), then one draw from the normalised
    residual max(0, p - q) at the first rejected position, or the sampler's own draw after the last draft."""
    tokens = list(drawn)
    vocab = p.shape[1]
    for j, draft in enumerate(drafts):
        u = float(_uniforms(keys[j], _ACCEPT_SALT, 1, p.device)[0])
        if u * float(q[j, draft]) <= float(p[j, draft]):
            tokens[j] = draft
            continue
        residual = (p[j] - q[j]).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: a rejection is then (nearly) impossible
            residual = p[j]
        gumbel = -torch.log(-torch.log(_uniforms(keys[j], _RESIDUAL_SALT, vocab, p.device)))
        scores = torch.where(residual > 0, torch.log(residual) + gumbel, float("-inf"))
        tokens[j] = int(scores.argmax())
        break
    return tokens
