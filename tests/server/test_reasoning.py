"""The reasoning parsers and their streaming state, on crafted texts cut into every kind of delta."""

from __future__ import annotations

import pytest
from pagoda.server.api.reasoning import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningStream,
    make_reasoning_parser,
)


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("<think>plan</think>answer", "plan", "answer"),
        ("<think>\nplan\n</think>\n\nanswer", "\nplan\n", "\n\nanswer"),
        ("no thinking here", "", "no thinking here"),  # enable_thinking=False: never opened
        ("plan</think>answer", "", "plan</think>answer"),  # vLLM's qwen3 needs the opening tag in the output
        ("<think>cut by max_tokens", "cut by max_tokens", ""),
        ("pre<think>plan</think>post", "plan", "prepost"),
        ("<think></think>answer", "", "answer"),
    ],
)
def test_qwen3_split(text: str, reasoning: str, content: str) -> None:
    """Qwen3: reasoning between the tags; no `<think>`, no reasoning."""
    assert Qwen3ReasoningParser().split(text) == (reasoning, content)


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("plan</think>answer", "plan", "answer"),  # the template wrote <think>
        ("<think>plan</think>answer", "plan", "answer"),  # R1-0528 writes it itself
        ("all reasoning, cut short", "all reasoning, cut short", ""),
        ("plan</think>answer</think>more", "plan", "answer</think>more"),
        ("</think>answer", "", "answer"),
    ],
)
def test_deepseek_r1_split(text: str, reasoning: str, content: str) -> None:
    """DeepSeek-R1: everything before `</think>` is reasoning."""
    assert DeepSeekR1ReasoningParser().split(text) == (reasoning, content)


def test_make_reasoning_parser_by_vllm_name() -> None:
    """The `--reasoning-parser` names select the classes."""
    assert isinstance(make_reasoning_parser("qwen3"), Qwen3ReasoningParser)
    assert isinstance(make_reasoning_parser("deepseek_r1"), DeepSeekR1ReasoningParser)


TEXTS = [
    "<think>plan a</think>answer b",
    "pre<think>x < y </thi</think>ans<",
    "plan</think>answer",
    "no tags at all <",
    "<thin",
    "<think>unfinished </th",
]


def _cuts(text: str, step: int) -> list[str]:
    """The growing prefixes of `text` a stream would see, `step` characters at a time."""
    return [text[:end] for end in range(step, len(text), step)] + [text]


@pytest.mark.parametrize("parser", [Qwen3ReasoningParser(), DeepSeekR1ReasoningParser()])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3, 7, 100])
def test_stream_deltas_reassemble_to_the_whole_split(parser: ReasoningParser, text: str, step: int) -> None:
    """However the text is cut, the deltas join to the non-streamed split, and no tag ever leaks into them."""
    stream = ReasoningStream(parser)
    prefixes = _cuts(text, step)
    reasoning, content = "", ""
    for i, prefix in enumerate(prefixes):
        r, c = stream.delta(prefix, finished=i == len(prefixes) - 1)
        reasoning += r
        content += c
    assert (reasoning, content) == parser.split(text)


def test_stream_holds_back_a_partial_tag_until_it_resolves() -> None:
    """`<thi` waits; once it becomes `<think>` the following text streams as reasoning, then content."""
    stream = ReasoningStream(Qwen3ReasoningParser())
    assert stream.delta("ok <thi", finished=False) == ("", "ok ")
    assert stream.delta("ok <think>hm", finished=False) == ("hm", "")
    assert stream.delta("ok <think>hm</", finished=False) == ("", "")
    assert stream.delta("ok <think>hm</think>yes", finished=False) == ("", "yes")
    assert stream.delta("ok <think>hm</think>yes<", finished=True) == ("", "<")


def test_stream_releases_a_false_alarm() -> None:
    """A `<` that does not become a tag is sent with the next delta."""
    stream = ReasoningStream(DeepSeekR1ReasoningParser())
    assert stream.delta("a <", finished=False) == ("a ", "")
    assert stream.delta("a <b", finished=False) == ("<b", "")
