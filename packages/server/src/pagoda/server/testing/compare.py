"""Comparisons of two engines' outputs that several test files make (a split engine against the plain one)."""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.server.outputs import RequestOutput


def assert_same_logprobs(
    want: Sequence[RequestOutput], got: Sequence[RequestOutput], max_tokens: int, tolerance: float
) -> None:
    """Same tokens, and sampled and prompt logprobs over the same candidates within `tolerance` of each other
    (every prompt position after the first, and `max_tokens` sampled ones, per request)."""
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        pairs = [*zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)]
        pairs += zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True)
        assert len(pairs) == len(a.prompt_token_ids) - 1 + max_tokens
        for x, y in pairs:
            assert x is not None and y is not None and set(x) == set(y)
            for token, entry in x.items():
                assert abs(entry.logprob - y[token].logprob) < tolerance
