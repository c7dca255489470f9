"""What /score, /rerank and `LLM.score` share: how two inputs pair up, the cosine of two embeddings, the ranking.

Pure Python (no torch): the API front end and the offline `LLM` both call it, and so do the engine-free tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class ScoreInputError(ValueError):
    """Inputs that do not pair up; `param` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def pair_up(
    text_1: str | Sequence[str], text_2: str | Sequence[str], names: tuple[str, str] = ("text_1", "text_2")
) -> list[tuple[str, str]]:
    """vLLM's pairing, and its mirror: a string (or a list of one) pairs with each item of the other side, and
    lists of equal length pair item by item; ScoreInputError naming the field of an empty list, or the second
    field when two lists of several items differ in length."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    for items, name in ((first, names[0]), (second, names[1])):
        if not items:
            raise ScoreInputError(f"{name} must not be an empty list", name)
    if len(first) == 1:
        first = first * len(second)
    elif len(second) == 1:
        second = second * len(first)
    elif len(first) != len(second):
        raise ScoreInputError(
            f"{names[0]} has {len(first)} items and {names[1]} {len(second)}: lists pair up item by item, so "
            f"they must have the same length (or one side be a single string)",
            names[1],
        )
    return list(zip(first, second, strict=True))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two vectors (0 when one is zero), in double precision."""
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norms if norms > 0.0 else 0.0


def ranking(scores: Sequence[float], top_n: int | None) -> list[int]:
    """The indices of `scores`, highest first (ties in input order), the first `top_n` of them (None or 0: all,
    as vLLM takes top_n 0)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order if not top_n else order[:top_n]
