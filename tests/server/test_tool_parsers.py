"""Tool-call parsers (hermes, llama3_json, mistral, and the forced `required` / named ones): whole outputs, and
streams fed in every chunking, whose reassembled deltas must equal the whole parse."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from pagoda.server.api.tool_fields import ChatTool, FunctionDefinition
from pagoda.server.api.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedToolCall,
    ParsedTools,
    RequiredToolCalls,
    ToolCallParser,
    ToolCallStream,
    ToolCallText,
    required_schema,
)
from pagoda.server.api.tool_parsers.json_scan import scan_object, scan_object_array
from pagoda.server.structured import StructuredOutputsParams, parse_grammar

WEATHER = ToolCallText("get_weather", '{"city": "Paris", "days": [1, 2], "note": "a}b\\"c{"}')
TIME = ToolCallText("get_time", "{}")

# (parser, output text, content, calls)
CASES: list[tuple[ToolCallParser, str, str, tuple[ToolCallText, ...]]] = [
    (
        HermesToolParser(),
        f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER.arguments}}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time"}</tool_call>',
        "Let me check.\n",
        (WEATHER, TIME),
    ),
    (
        HermesToolParser(),
        f'<tool_call>{{"arguments": {WEATHER.arguments}, "name": "get_weather"}}</tool_call> trailing text',
        "",
        (WEATHER,),
    ),
    (
        HermesToolParser(),
        "no call here, just a < sign and <tool",
        "no call here, just a < sign and <tool",
        (),
    ),
    (HermesToolParser(), "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", ()),
    (
        Llama3JsonToolParser(),
        f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER.arguments}}}; {{"name": "get_time", '
        '"parameters": {}}',
        "",
        (WEATHER, TIME),
    ),
    (
        Llama3JsonToolParser(),
        f'  {{"name": "get_weather", "arguments": {WEATHER.arguments}}}',
        "",
        (WEATHER,),
    ),
    (Llama3JsonToolParser(), '{"answer": 42}', '{"answer": 42}', ()),
    (Llama3JsonToolParser(), "The answer is 42.", "The answer is 42.", ()),
    (
        MistralToolParser(),
        f'Sure. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER.arguments}}}, '
        '{"name": "get_time", "arguments": {}}]',
        "Sure. ",
        (WEATHER, TIME),
    ),
    (
        MistralToolParser(),
        f'[TOOL_CALLS]{{"name": "get_weather", "arguments": {WEATHER.arguments}}}',
        "",
        (WEATHER,),
    ),
    (MistralToolParser(), "plain [TOOL", "plain [TOOL", ()),
    (
        RequiredToolCalls(),
        f'[ {{"name": "get_weather", "parameters": {WEATHER.arguments}}},{{"parameters": {{}}, "name": "get_time"}}]',
        "",
        (WEATHER, TIME),
    ),
    (RequiredToolCalls(), '[{"name": "get_we', '[{"name": "get_we', ()),
    (NamedToolCall("get_weather"), WEATHER.arguments, "", (WEATHER,)),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_output(
    parser: ToolCallParser, text: str, content: str, calls: tuple[ToolCallText, ...]
) -> None:
    """The finished text splits into the expected content and calls, and every call's arguments are JSON."""
    assert parser.parse(text, final=True) == ParsedTools(content, calls)
    for call in calls:
        json.loads(call.arguments)


def _stream(parser: ToolCallParser, text: str, cuts: list[int]) -> tuple[str, list[ToolCallText], list[str]]:
    """Feed `text` cut at `cuts`; reassemble the content, the calls (by index) and the ids."""
    stream = ToolCallStream(parser)
    content = ""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    ids: dict[int, str] = {}
    for end in [*cuts, len(text)]:
        new_content, deltas = stream.delta(text[:end], finished=end == len(text))
        content += new_content
        for delta in deltas:
            if delta.index not in names:
                # The first delta of a call carries its id, type and name, and nothing else ever does.
                assert delta.index == len(names) and delta.id is not None and delta.type == "function"
                assert delta.function.name is not None
                names[delta.index] = delta.function.name
                ids[delta.index] = delta.id
                arguments[delta.index] = ""
            else:
                assert delta.id is None and delta.type is None and delta.function.name is None
                assert delta.function.arguments
            arguments[delta.index] += delta.function.arguments or ""
    calls = [ToolCallText(names[i], arguments[i]) for i in range(len(names))]
    return content, calls, list(ids.values())


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streams_reassemble_to_the_whole_output(
    parser: ToolCallParser, text: str, content: str, calls: tuple[ToolCallText, ...]
) -> None:
    """One character at a time, and in random chunks: the deltas join to the whole parse, ids are distinct."""
    rng = random.Random(0)
    chunkings = [list(range(1, len(text)))]
    chunkings += [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6))) for _ in range(20)]
    for cuts in chunkings:
        streamed_content, streamed_calls, ids = _stream(parser, text, cuts)
        assert (streamed_content, tuple(streamed_calls)) == (content, calls)
        assert len(set(ids)) == len(ids) and all(i.startswith("chatcmpl-tool-") for i in ids)


def test_arguments_stream_in_fragments_before_the_call_closes() -> None:
    """A call's start goes out once its name is known, its arguments while the model writes them."""
    stream = ToolCallStream(HermesToolParser())
    text = '<tool_call>{"name": "f", "arguments": {"city": "Par'
    content, deltas = stream.delta(text, finished=False)
    assert content == "" and [(d.function.name, d.function.arguments) for d in deltas] == [
        ("f", '{"city": "Par')
    ]
    _, deltas = stream.delta(text + 'is"}}</tool_call>', finished=True)
    assert [(d.index, d.function.arguments) for d in deltas] == [(0, 'is"}')]
    assert stream.called


def test_content_waits_while_it_may_become_a_tag() -> None:
    """`<tool_c` is held back until the next text settles it; at the end it is content."""
    stream = ToolCallStream(HermesToolParser())
    assert stream.delta("Hi <tool_c", finished=False) == ("Hi ", [])
    assert stream.delta("Hi <tool_cx", finished=False) == ("<tool_cx", [])
    stream = ToolCallStream(HermesToolParser())
    assert stream.delta("Hi <tool_c", finished=False) == ("Hi ", [])
    assert stream.delta("Hi <tool_c", finished=True) == ("<tool_c", [])


def test_max_calls_keeps_the_first() -> None:
    """parallel_tool_calls false: only the first call is sent."""
    text = CASES[0][1]
    stream = ToolCallStream(HermesToolParser(), max_calls=1)
    _, deltas = stream.delta(text, finished=True)
    assert {d.index for d in deltas} == {0} and deltas[0].function.name == "get_weather"


def test_scanner_spans_and_broken_json() -> None:
    """Values are located by raw span; a value that stops being JSON stays open, so spans only grow."""
    text = '{"a": "x}\\"", "b": [1, {"c": "]"}], "d": 12'
    scan = scan_object(text, 0)
    assert [(m.key, text[m.start : m.end] if m.end else None) for m in scan.members] == [
        ("a", '"x}\\""'),
        ("b", '[1, {"c": "]"}]'),
        ("d", None),  # a number is only known to end when something follows it
    ]
    assert scan.end is None and not scan.broken
    broken = scan_object('{"a": [1}', 0)
    assert broken.broken and broken.members[0].end is None
    objects = scan_object_array('[{"a": 1}, {"b": 2}, 3]', 0)
    assert [o.end is not None for o in objects] == [True, True]


def _tool(name: str, parameters: dict[str, Any] | None) -> ChatTool:
    return ChatTool(type="function", function=FunctionDefinition(name=name, parameters=parameters))


def test_required_schema_lifts_defs_and_parses() -> None:
    """The `required` schema: an array of {name, parameters} alternatives, `$defs` at the root, maxItems 1
    without parallel calls; xgrammar parses it."""
    point = {
        "$defs": {"P": {"type": "integer"}},
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/P"}},
    }
    schema = required_schema([_tool("a", point), _tool("b", None)], parallel=False)
    assert (
        schema["$defs"] == {"P": {"type": "integer"}} and schema["maxItems"] == 1 and schema["minItems"] == 1
    )
    names = [alt["properties"]["name"]["enum"] for alt in schema["items"]["anyOf"]]
    assert names == [["a"], ["b"]]
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    parse_grammar(StructuredOutputsParams(json=schema))
    assert "maxItems" not in required_schema([_tool("a", None)], parallel=True)
