"""`AutoProposer`: the `auto` method's drafts, prompt lookup and suffix decoding side by side.

Each sequence asks both model-free proposers and keeps the longer draft (prompt lookup's on a tie: a match in the
sequence's own text). Whether it drafts at all, and how many tokens, is the back-off policy's call
(`spec/policy.py`, the same for every method): from the engine's measured step costs, the batch size and the
sequence's acceptance so far, so a lone stream drafts while a saturated batch does not, and a sequence whose
drafts keep failing stops drafting and probes again later (`AcceptanceEstimate.relax`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.server.spec.ngram import NgramProposer
from pagoda.server.spec.suffix import SuffixIndex, SuffixProposer


class AutoProposer:
    """Prompt lookup and suffix decoding over one engine-wide index; the longer of their drafts."""

    def __init__(self, index: SuffixIndex, num_tokens: int, min_n: int, max_n: int) -> None:
        """Draft up to `num_tokens` tokens; `min_n`..`max_n`: prompt lookup's suffix sizes."""
        self.ngram = NgramProposer(num_tokens, min_n, max_n)
        self.suffix = SuffixProposer(index, num_tokens)

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """The longer of the two proposers' drafts (prompt lookup's on a tie); () when neither has one."""
        # The suffix proposer always runs: it feeds the sequence's new tokens to the shared index.
        from_suffix = self.suffix.propose(token_ids, max_tokens)
        from_lookup = self.ngram.propose(token_ids, max_tokens)
        return from_suffix if len(from_suffix) > len(from_lookup) else from_lookup
