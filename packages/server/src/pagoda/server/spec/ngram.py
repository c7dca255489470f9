"""`NgramProposer`: prompt lookup (vLLM's `ngram` method) over the sequence's own prompt and output."""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    """Finds the latest earlier occurrence of the sequence's last n tokens (n from `max_n` down to `min_n`)
    and drafts the tokens that followed it there."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        """Draft up to `num_tokens` tokens, matching suffixes of `min_n` to `max_n` tokens."""
        if not 1 <= min_n <= max_n or num_tokens < 1:
            raise ValueError(f"bad n-gram sizes: {min_n=} {max_n=} {num_tokens=}")
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """Drafts after the latest match of the longest suffix that occurred before; () without a match."""
        k = min(self.num_tokens, max_tokens)
        length = len(token_ids)
        if k < 1 or length <= self.min_n:
            return ()
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = list(token_ids[length - n :])
            last = suffix[-1]
            # Latest start first: recent text is the likelier continuation. An occurrence must end before the
            # suffix itself does, so that at least one token follows it.
            for end in range(length - 2, n - 2, -1):
                if token_ids[end] == last and list(token_ids[end - n + 1 : end + 1]) == suffix:
                    return tuple(token_ids[end + 1 : end + 1 + k])
        return ()
