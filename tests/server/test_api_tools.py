"""Tool calling through the HTTP API over the fake engine: each `--tool-call-parser` on scripted outputs, whole
and streamed, tools and tool-call history through the chat template, and every bad tool field a 400."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, cast

import httpx
import openai
import pytest
from api_fake_engine import LETTERS, FakeEngine, _Req, _Seq, serve_in_thread
from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageFunctionToolCall
from pagoda.server.api import AppSettings
from pagoda.server.config import ToolParserName
from pagoda.server.sampling_params import SamplingParams

MODEL = "test-model"
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
MESSAGES: Any = [{"role": "user", "content": "weather in Paris?"}]
SCRIPTS: dict[ToolParserName, str] = {
    "hermes": f'Checking.<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    "llama3_json": f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER_ARGS}}}; '
    '{"name": "get_time", "parameters": {}}',
    "mistral": f'Checking.[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}, '
    '{"name": "get_time", "arguments": {}}]',
}
CONTENT: dict[ToolParserName, str | None] = {
    "hermes": "Checking.",
    "llama3_json": None,
    "mistral": "Checking.",
}
CALLS = [("get_weather", WEATHER_ARGS), ("get_time", "{}")]


class ScriptedEngine(FakeEngine):
    """The fake engine, but every sample writes `script` one character per step and stops at its end; the
    params of every request are kept (at its first step)."""

    def __init__(self, script: str, **kwargs: Any) -> None:
        # A step takes a real engine's milliseconds: a stream that keeps up then gets a delta per token
        # (snapshots a reader has not taken yet are merged, so an instant engine would send one big delta).
        super().__init__(max_model_len=4096, **{"step_seconds": 0.003, **kwargs})
        self.script = script
        self.params: list[SamplingParams] = []

    def _advance(self, req: _Req, seq: _Seq) -> None:
        position = len(seq.token_ids)
        if position == 0 and seq.index == 0:
            self.params.append(req.params)
        seq.token_ids.append(self._letter_ids[position % len(LETTERS)])  # the ids do not matter here
        seq.text += self.script[position]
        self.generation_tokens += 1
        if len(seq.token_ids) == len(self.script):
            seq.finish_reason = "stop"
        elif len(seq.token_ids) >= req.params.max_tokens:
            seq.finish_reason = "length"


def function_calls(message: ChatCompletionMessage) -> list[tuple[str, str]]:
    """(name, arguments) of a message's tool calls, all function calls."""
    calls = message.tool_calls or []
    assert all(isinstance(c, ChatCompletionMessageFunctionToolCall) for c in calls)
    return [
        (c.function.name, c.function.arguments)
        for c in cast(list[ChatCompletionMessageFunctionToolCall], calls)
    ]


def schema_of(params: SamplingParams) -> Any:
    """The JSON schema a request's params enforce."""
    constraint = params.structured_outputs
    assert constraint is not None and isinstance(constraint.json, str)
    return json.loads(constraint.json)


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def reassemble(chunks: Sequence[Any]) -> tuple[str | None, list[tuple[str, str]], list[str], str | None]:
    """(content, calls, ids, finish reason) of one choice's stream, checking each call opens in OpenAI's shape."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    ids: list[str] = []
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            finish = choice.finish_reason or finish
            content += [delta.content] if delta.content else []
            for call in delta.tool_calls or []:
                if call.index not in calls:
                    assert (
                        call.id
                        and call.type == "function"
                        and call.function.name
                        and call.index == len(calls)
                    )
                    calls[call.index] = [call.function.name, call.function.arguments or ""]
                    ids.append(call.id)
                else:
                    assert call.id is None and call.function.name is None
                    calls[call.index][1] += call.function.arguments or ""
    return "".join(content) or None, [(n, a) for n, a in calls.values()], ids, finish


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_auto_tool_choice_parses_calls_whole_and_streamed(parser: ToolParserName) -> None:
    """`--enable-auto-tool-choice --tool-call-parser NAME`: the scripted calls come back as tool_calls with
    fresh ids and finish_reason tool_calls; the stream's deltas reassemble to the same message."""
    engine = ScriptedEngine(SCRIPTS[parser])
    settings = AppSettings(enable_auto_tool_choice=True, tool_call_parser=parser)
    with serve_in_thread(engine, settings=settings) as running:
        client = _client(running.base_url)
        whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=500)
        message = whole.choices[0].message
        assert function_calls(message) == CALLS
        assert all(
            c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in message.tool_calls or []
        )
        assert message.content == CONTENT[parser] and whole.choices[0].finish_reason == "tool_calls"
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=500, stream=True
            )
        )
        content, streamed, ids, finish = reassemble(chunks)
        assert (content, streamed, finish) == (CONTENT[parser], CALLS, "tool_calls")
        assert len(set(ids)) == 2
        # The arguments arrive in fragments, not in one piece at the end.
        fragments = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or []) if c.id is None]
        assert len(fragments) > 1
        # Auto keeps special tokens in the text: the models' call markers are special tokens.
        assert [p.skip_special_tokens for p in engine.params] == [False, False]
        # parallel_tool_calls false: the first call only.
        one = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=500, parallel_tool_calls=False
        )
        assert [name for name, _ in function_calls(one.choices[0].message)] == ["get_weather"]
        # tool_choice "none": the same output is all content, and nothing is parsed.
        plain = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=500
        )
        assert plain.choices[0].message.content == SCRIPTS[parser]
        assert not plain.choices[0].message.tool_calls and plain.choices[0].finish_reason == "stop"


def test_plain_answer_under_auto_is_content() -> None:
    """Auto with no call in the output: content and finish_reason stop, whole and streamed."""
    text = "It is sunny <b>today</b>."
    settings = AppSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serve_in_thread(ScriptedEngine(text), settings=settings) as running:
        client = _client(running.base_url)
        whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=500)
        assert whole.choices[0].message.content == text and whole.choices[0].finish_reason == "stop"
        chunks = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=500, stream=True
        )
        assert reassemble(list(chunks)) == (text, [], [], "stop")


def test_required_and_named_choices_pass_the_schema_to_structured_outputs() -> None:
    """ "required" sends vLLM's array schema, a named choice the function's parameters; the output is read back as
    calls without any --tool-call-parser."""
    named_script = WEATHER_ARGS
    engine = ScriptedEngine(named_script)
    with serve_in_thread(engine) as running:
        client = _client(running.base_url)
        named = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=500,
        )
        assert schema_of(engine.params[-1]) == TOOLS[0]["function"]["parameters"]
        assert function_calls(named.choices[0].message) == [("get_weather", WEATHER_ARGS)]
        assert named.choices[0].finish_reason == "stop"  # as vLLM: a named call finishes as the output did
    required_script = f'[{{"name": "get_weather", "parameters": {WEATHER_ARGS}}}]'
    engine = ScriptedEngine(required_script)
    with serve_in_thread(engine) as running:
        client = _client(running.base_url)
        required = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=500
        )
        schema = schema_of(engine.params[-1])
        assert schema["type"] == "array" and schema["minItems"] == 1
        assert [a["properties"]["name"]["enum"] for a in schema["items"]["anyOf"]] == [
            ["get_weather"],
            ["get_time"],
        ]
        assert function_calls(required.choices[0].message) == [("get_weather", WEATHER_ARGS)]
        assert (
            required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.content is None
        )
        # Streamed, the call opens with its id and name, then its arguments arrive in fragments as they are
        # written (the engine's steps are paced, so the stream is not one merged delta).
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice="required",
                max_tokens=500,
                stream=True,
            )
        )
        content, streamed, ids, finish = reassemble(chunks)
        assert (content, streamed, finish) == (None, [("get_weather", WEATHER_ARGS)], "tool_calls")
        fragments = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or []) if c.id is None]
        assert len(ids) == 1 and len(fragments) > 1


HISTORY_TEMPLATE = (
    "{% for t in tools or [] %}T:{{ t['function']['name'] }};{% endfor %}"
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}C:{{ c['id'] }},{{ c['function']['name'] }},"
    "{{ c['function']['arguments']['city'] }}{% endfor %}"
    "{% if m['tool_call_id'] %}R:{{ m['tool_call_id'] }}{% endif %};{% endfor %}"
)
HISTORY: Any = [
    {"role": "user", "content": "weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": WEATHER_ARGS},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_tools_and_tool_history_reach_the_template() -> None:
    """Tools are the template's `tools`; an assistant message's calls carry their arguments as a dict, a tool
    message its tool_call_id (the server's --chat-template, read back through /tokenize and /detokenize)."""
    settings = AppSettings(chat_template=HISTORY_TEMPLATE)
    with serve_in_thread(ScriptedEngine("ok"), settings=settings) as running:
        body = {"model": MODEL, "messages": HISTORY, "tools": TOOLS, "add_generation_prompt": False}
        tokens = httpx.post(f"{running.base_url}/tokenize", json=body).json()["tokens"]
        text = httpx.post(f"{running.base_url}/detokenize", json={"model": MODEL, "tokens": tokens}).json()
        expected = (
            "T:get_weather;T:get_time;user:weather?;assistant:C:call_1,get_weather,Paris;tool:sunnyR:call_1;"
        )
        assert text["prompt"] == expected
        reply = _client(running.base_url).chat.completions.create(
            model=MODEL, messages=HISTORY, tools=TOOLS, tool_choice="none", max_tokens=5
        )
        assert reply.choices[0].message.content == "ok"
        assert reply.usage is not None and reply.usage.prompt_tokens == len(expected)


def _tool_with_def(name: str, point_type: str) -> dict[str, Any]:
    """A tool whose parameters refer to a `$defs` entry named P."""
    parameters = {
        "$defs": {"P": {"type": point_type}},
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P"}},
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _bad_cases() -> list[tuple[dict[str, Any], str]]:
    weather_choice = {"type": "function", "function": {"name": "get_weather"}}
    return [
        ({"tools": TOOLS}, "tool_choice"),  # auto (the default with tools) without the server's flags
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": weather_choice}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
                "tool_choice": "none",
            },
            "tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"tools": TOOLS, "tool_choice": weather_choice, "guided_regex": "a+"}, "guided_regex"),
        ({"tools": TOOLS, "tool_choice": "none", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {
                "tools": [_tool_with_def("a", "integer"), _tool_with_def("b", "string")],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "x"}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "x", "type": "function"}]}]}, "messages"),
    ]


def test_bad_tool_fields_are_400_naming_them() -> None:
    """Each bad tool field or message is a 400 whose param names it; then a good request succeeds."""
    with serve_in_thread(ScriptedEngine("ok")) as running:
        for extra, param in _bad_cases():
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra}
            response = httpx.post(f"{running.base_url}/v1/chat/completions", json=body)
            assert response.status_code == 400, (extra, response.text)
            assert response.json()["error"]["param"] == param, (extra, response.text)
            good = {
                "model": MODEL,
                "messages": MESSAGES,
                "max_tokens": 2,
                "tools": TOOLS,
                "tool_choice": "none",
            }
            assert httpx.post(f"{running.base_url}/v1/chat/completions", json=good).status_code == 200
        error = httpx.post(
            f"{running.base_url}/v1/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS},
        ).json()["error"]
        assert "--enable-auto-tool-choice" in cast(str, error["message"])


def test_reasoning_then_tool_calls() -> None:
    """With --reasoning-parser too, the think block is reasoning_content and the calls are read from the content
    after it, whole and streamed."""
    script = "<think>need <tool_call> data</think>Ok." + SCRIPTS["hermes"].removeprefix("Checking.")
    settings = AppSettings(reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serve_in_thread(ScriptedEngine(script), settings=settings) as running:
        client = _client(running.base_url)
        whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=500)
        message: Any = whole.choices[0].message
        assert (message.reasoning_content, message.content) == ("need <tool_call> data", "Ok.")
        assert function_calls(message) == CALLS and whole.choices[0].finish_reason == "tool_calls"
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=500, stream=True
            )
        )
        reasoning = "".join(
            getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
        )
        assert reasoning == "need <tool_call> data"
        assert reassemble(chunks)[:2] == ("Ok.", CALLS) and reassemble(chunks)[3] == "tool_calls"
