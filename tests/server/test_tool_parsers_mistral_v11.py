"""Mistral v11's tool-call format (issue 26), `[TOOL_CALLS]name[ARGS]{...}` once per call: whole outputs, and
streams in every chunking reassembling to the whole parse."""

from __future__ import annotations

import json
import random

import pytest
from pagoda.server.api.tool_parsers import MistralToolParser, ParsedTools, ToolCallText
from test_tool_parsers import _stream

WEATHER = ToolCallText("get_weather", '{"city": "Paris", "note": "a}[ARGS]b\\"c{"}')
TIME = ToolCallText("get_time", "{}")

CASES: list[tuple[str, str, tuple[ToolCallText, ...]]] = [
    (f"[TOOL_CALLS]get_weather[ARGS]{WEATHER.arguments}", "", (WEATHER,)),
    (
        f"Sure. [TOOL_CALLS]get_weather[ARGS]{WEATHER.arguments}[TOOL_CALLS]get_time[ARGS]{{}}",
        "Sure. ",
        (WEATHER, TIME),
    ),
    ("[TOOL_CALLS] get_time [ARGS] {}", "", (TIME,)),
    ("[TOOL_CALLS]not a name[ARGS]{}", "[TOOL_CALLS]not a name[ARGS]{}", ()),
    ("[TOOL_CALLS]get_time[ARGS]42", "[TOOL_CALLS]get_time[ARGS]42", ()),
    ("[TOOL_CALLS]get_time", "[TOOL_CALLS]get_time", ()),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole_v11_output(text: str, content: str, calls: tuple[ToolCallText, ...]) -> None:
    """Content before the first tag, then each call's name and arguments (JSON); a broken form is content."""
    assert MistralToolParser().parse(text, final=True) == ParsedTools(content, calls)
    for call in calls:
        json.loads(call.arguments)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_v11_streams_reassemble(text: str, content: str, calls: tuple[ToolCallText, ...]) -> None:
    """One character at a time and in random chunks, the deltas join to the whole parse."""
    rng = random.Random(1)
    chunkings = [list(range(1, len(text)))]
    chunkings += [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6))) for _ in range(20)]
    for cuts in chunkings:
        streamed_content, streamed_calls, _ = _stream(MistralToolParser(), text, cuts)
        assert (streamed_content, tuple(streamed_calls)) == (content, calls)


def test_v11_arguments_stream_before_the_object_closes() -> None:
    """A call is listed once `[ARGS]` is written; its arguments grow with the text."""
    parsed = MistralToolParser().parse('[TOOL_CALLS]f[ARGS]{"a": "b', final=False)
    assert parsed == ParsedTools("", (ToolCallText("f", '{"a": "b'),))
    assert MistralToolParser().parse("[TOOL_CALLS]f[AR", final=False) == ParsedTools("")
