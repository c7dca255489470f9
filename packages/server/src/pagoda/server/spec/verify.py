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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine imports this module: no import of the engine at run time
    from pagoda.server.engine.engine_request import DrawSpec


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
