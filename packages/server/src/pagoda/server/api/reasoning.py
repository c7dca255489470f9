"""Reasoning parsers (`--reasoning-parser`): split a reasoning model's text into `reasoning_content` and `content`.

They work on the detokenized text, not on token ids (vLLM matches the `<think>` tokens by id): the tags are
matched as strings, and a stream holds back a tail that could still grow into a tag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pagoda.server.config import ReasoningParserName

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser(Protocol):
    """Splits a (possibly partial) output text into reasoning and content."""

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of `text`; on a growing text both only ever grow (the stream relies on it)."""
        ...


class Qwen3ReasoningParser:
    """Qwen3: reasoning is the text between `<think>` and `</think>`; without `<think>` all of it is content.

    As vLLM's `qwen3` parser: output that never opens a think block (`enable_thinking=False`) is content.
    Unlike vLLM's non-streamed path, a block opened but never closed (cut by max_tokens) is reasoning in both
    the streamed and whole responses, so the two always agree.
    """

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content): content is what precedes `<think>` plus what follows `</think>`."""
        before, start, rest = text.partition(THINK_START)
        if not start:
            return "", text
        reasoning, end, after = rest.partition(THINK_END)
        return reasoning, before + after if end else before


class DeepSeekR1ReasoningParser:
    """DeepSeek-R1: everything before `</think>` is reasoning (the template already wrote `<think>`).

    As vLLM's `deepseek_r1` parser: a `<think>` the model writes itself at the start is dropped, and output
    without `</think>` is all reasoning.
    """

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) around the first `</think>`."""
        body = text.removeprefix(THINK_START)
        reasoning, _, content = body.partition(THINK_END)
        return reasoning, content


def make_reasoning_parser(name: ReasoningParserName) -> ReasoningParser:
    """The parser vLLM's `--reasoning-parser NAME` selects."""
    if name == "qwen3":
        return Qwen3ReasoningParser()
    return DeepSeekR1ReasoningParser()


def _partial_tag_len(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a tag (it may still become one)."""
    for size in range(min(len(text), len(THINK_END) - 1), 0, -1):
        tail = text[-size:]
        if THINK_START.startswith(tail) or THINK_END.startswith(tail):
            return size
    return 0


@dataclass(slots=True)
class ReasoningStream:
    """How much reasoning and content one streamed choice has sent; `delta` turns its growing text into both."""

    parser: ReasoningParser
    reasoning_len: int = 0
    content_len: int = 0

    def delta(self, text: str, *, finished: bool) -> tuple[str, str]:
        """The (reasoning, content) that `text`, the choice's whole text so far, adds to what was sent.

        A tail that could still become a tag waits for the next call, unless the choice has finished.
        """
        settled = text if finished else text[: len(text) - _partial_tag_len(text)]
        reasoning, content = self.parser.split(settled)
        new_reasoning = reasoning[self.reasoning_len :]
        new_content = content[self.content_len :]
        self.reasoning_len = max(self.reasoning_len, len(reasoning))
        self.content_len = max(self.content_len, len(content))
        return new_reasoning, new_content
