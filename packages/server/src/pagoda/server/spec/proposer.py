"""The proposer interface: k draft tokens from a sequence's tokens so far (prompt then outputs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """Drafts the tokens likely to follow a sequence; model-free proposers are point masses (q = 1 on each)."""

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """At most `max_tokens` drafts to follow `token_ids` (empty: no guess worth checking)."""
        ...
