"""`SuffixProposer`: suffix decoding (vLLM's `suffix` method) over this sequence and recent other sequences.

One `SuffixIndex` per engine holds, for every context of 1 to `max_depth` tokens seen at the end of some
sequence prefix, how often each next token followed it: the paths of a suffix tree of depth `max_depth` over
every sequence fed to it, counted. It is bounded: past `max_contexts` contexts the least recently updated go,
so it holds the recent outputs of other requests and this one's own prompt and output. A proposal follows the
longest context that ends the sequence, then the most frequent next token while the product of the chosen
tokens' frequencies stays above `min_token_prob`, for at most `max_spec_factor` times the matched length: a
pattern seen often and consistently gets long drafts, a rare or ambiguous one short drafts or none.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SuffixIndex:
    """Next-token counts of every recent context of 1 to `max_depth` tokens, at most `max_contexts` of them."""

    def __init__(self, max_depth: int = 8, max_contexts: int = 65_536) -> None:
        """An empty index."""
        if max_depth < 1 or max_contexts < 1:
            raise ValueError(f"bad suffix index bounds: {max_depth=} {max_contexts=}")
        self.max_depth = max_depth
        self.max_contexts = max_contexts
        self._next: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()

    def __len__(self) -> int:
        """Contexts held."""
        return len(self._next)

    def add(self, token_ids: Sequence[int], start: int) -> None:
        """Count tokens token_ids[start:] after each of their contexts (the tokens before them in the list)."""
        table = self._next
        for i in range(max(start, 1), len(token_ids)):
            token = token_ids[i]
            for depth in range(1, min(self.max_depth, i) + 1):
                context = tuple(token_ids[i - depth : i])
                counts = table.get(context)
                if counts is None:
                    counts = table[context] = {}
                else:
                    table.move_to_end(context)
                counts[token] = counts.get(token, 0) + 1
        while len(table) > self.max_contexts:
            table.popitem(last=False)

    def longest_context(self, token_ids: Sequence[int]) -> tuple[int, ...] | None:
        """The longest suffix of `token_ids` (at most `max_depth` tokens) with known next tokens."""
        for depth in range(min(self.max_depth, len(token_ids)), 0, -1):
            context = tuple(token_ids[len(token_ids) - depth :])
            if context in self._next:
                return context
        return None

    def next_counts(self, context: tuple[int, ...]) -> dict[int, int] | None:
        """How often each token followed `context`, or None for an unknown context."""
        return self._next.get(context)


class SuffixProposer:
    """Drafts one sequence's tokens from a shared `SuffixIndex`, feeding the sequence's new tokens to it first."""

    def __init__(
        self, index: SuffixIndex, num_tokens: int, max_spec_factor: float = 1.0, min_token_prob: float = 0.1
    ) -> None:
        """Draft up to `num_tokens` tokens."""
        self.index = index
        self.num_tokens = num_tokens
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._fed = 0  # tokens of the sequence already counted in the index

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """Count the sequence's new tokens, then follow the most frequent continuation of its longest match."""
        self.index.add(token_ids, self._fed)
        self._fed = len(token_ids)
        context = self.index.longest_context(token_ids)
        if context is None:
            return ()
        limit = min(self.num_tokens, max_tokens, max(1, int(self.max_spec_factor * len(context))))
        drafts: list[int] = []
        path = [*token_ids[len(token_ids) - len(context) :]]
        prob = 1.0
        while len(drafts) < limit:
            counts = self.index.next_counts(tuple(path[len(path) - len(context) :]))
            if counts is None:
                # The path left the counted contexts at this depth: try the longest shorter one.
                shorter = self.index.longest_context(path)
                counts = None if shorter is None else self.index.next_counts(shorter)
                if counts is None:
                    break
            token, count = max(counts.items(), key=lambda item: item[1])
            prob *= count / sum(counts.values())
            if prob < self.min_token_prob:
                break
            drafts.append(token)
            path.append(token)
        return tuple(drafts)
