"""Streamed tool-call parsing is incremental: a stream's scans resume, so its work grows linearly with the text,
and every prefix parses exactly as a one-off parse does."""

from __future__ import annotations

import pytest
from pagoda.server.api.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    RequiredToolCalls,
    ToolCallParser,
    ToolCallStream,
)
from pagoda.server.api.tool_parsers.json_scan import ScanCache
from test_tool_parsers import CASES

BROKEN: list[tuple[ToolCallParser, str]] = [
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {"a": 1}} x <tool_call>{"name": 3}'),
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {"a": "\x01"}}</tool_call>'),
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {"a": ]}}</tool_call>'),
    (Llama3JsonToolParser(), '{"name": "f", "parameters": tru, "x": 1}; {"name": "g"}'),
    (MistralToolParser(), '[TOOL_CALLS] [{"name": "f", "arguments": {}} {"name": "g"}]'),
    (RequiredToolCalls(), '[{"name": "f", "parameters": {"s": "a\\"b"}}, {"name" "g"}]'),
]


@pytest.mark.parametrize(
    ("parser", "text"), [(p, t) for p, t, _, _ in CASES] + BROKEN, ids=lambda v: type(v).__name__
)
def test_every_prefix_parses_as_a_one_off_parse(parser: ToolCallParser, text: str) -> None:
    """One cache over the growing text gives, at every prefix, the parse of a fresh scan (final or not)."""
    cache = ScanCache()
    for end in range(len(text) + 1):
        prefix = text[:end]
        assert parser.parse(prefix, final=False, cache=cache) == parser.parse(prefix, final=False)
    assert parser.parse(text, final=True, cache=cache) == parser.parse(text, final=True)


def _long_call(parser: ToolCallParser, size: int) -> str:
    """One call whose arguments hold a `size`-character string and a `size`-element nested array."""
    body = '{"s": "' + "ab\\n" * (size // 4) + '", "l": [' + ", ".join(["[1]"] * (size // 8)) + "]}"
    if isinstance(parser, HermesToolParser):
        return f'Sure.<tool_call>{{"name": "f", "arguments": {body}}}</tool_call>'
    if isinstance(parser, MistralToolParser):
        return f'Sure.[TOOL_CALLS][{{"name": "f", "arguments": {body}}}]'
    return f'{{"name": "f", "parameters": {body}}}'


@pytest.mark.parametrize(
    "parser", [HermesToolParser(), Llama3JsonToolParser(), MistralToolParser(), RequiredToolCalls()]
)
def test_stream_work_grows_linearly(parser: ToolCallParser) -> None:
    """Fed one character at a time, a stream scans each character a bounded number of times (a one-off parse
    of every prefix scans quadratically many: the counter measures real work)."""
    text = _long_call(parser, 4000)
    if isinstance(parser, RequiredToolCalls):
        text = "[" + text + "]"
    stream = ToolCallStream(parser)
    arguments = ""
    for end in range(1, len(text) + 1):
        _, deltas = stream.delta(text[:end], finished=end == len(text))
        arguments += "".join(d.function.arguments or "" for d in deltas)
    assert arguments == parser.parse(text, final=True).calls[0].arguments
    assert 0 < stream.cache.scanned <= 3 * len(text)
    fresh = 0
    for end in range(1, len(text) + 1, 50):  # every 50th prefix is enough to show the quadratic cost
        cache = ScanCache()
        parser.parse(text[:end], final=False, cache=cache)
        fresh += cache.scanned
    assert fresh > 5 * len(text)
