"""Tool calling (issue 16) through the live server on a tiny random-weight model and the official openai client:
random weights make "required" and named calls valid only where the grammar enforces the tools' schemas."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal, cast

import openai
import pytest
from api_cases import MODEL
from openai.types.chat import ChatCompletionToolParam
from pagoda.server.testing import make_tiny_model
from pydantic import BaseModel, ConfigDict, Field
from test_api_live import LiveServer, assert_good_request, serving, sync_client
from test_api_tools import function_calls, reassemble

MAX_TOKENS = 800  # room for a schema-bounded array of calls to close (each test checks finish_reason)


class Weather(BaseModel):
    """Arguments of get_weather: a bounded string, an enum, a bounded integer."""

    model_config = ConfigDict(extra="forbid")
    # Letters only: with a byte-level vocabulary xgrammar 0.2 lets a free string end inside a UTF-8 sequence.
    city: str = Field(pattern=r"^[a-z]{1,8}$")
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


class Booking(BaseModel):
    """Arguments of book_table: a bounded array and a boolean."""

    model_config = ConfigDict(extra="forbid")
    guests: list[Annotated[int, Field(ge=1, le=9)]] = Field(max_length=3)
    confirm: bool


ARGUMENTS: dict[str, type[BaseModel]] = {"get_weather": Weather, "book_table": Booking}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": name, "parameters": model.model_json_schema()}}
    for name, model in ARGUMENTS.items()
]
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_CHOICE: Any = {"type": "function", "function": {"name": "get_weather"}}
HERMES_CALL = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "paris", "unit": "celsius", "days": 2}}'
)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server over a tiny random Llama, with auto tool choice read by the hermes parser."""
    path = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=4096)
    flags = ("--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with serving(path, *flags) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    """The official synchronous OpenAI client."""
    return sync_client(live)


def assert_valid(calls: list[tuple[str, str]]) -> None:
    """Every call names a tool and its arguments validate against that tool's schema."""
    assert calls
    for name, arguments in calls:
        ARGUMENTS[name].model_validate_json(arguments)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_calls_validate_against_their_schemas(client: openai.OpenAI, temperature: float) -> None:
    """tool_choice "required" with parallel_tool_calls false: exactly one call per sample, its arguments valid
    for its function, finish_reason tool_calls."""
    result = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=temperature,
        n=1 if temperature == 0.0 else 3,
        seed=11,
    )
    for choice in result.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        calls = function_calls(choice.message)
        assert len(calls) == 1
        assert_valid(calls)


def test_required_parallel_calls_each_validate(client: openai.OpenAI) -> None:
    """tool_choice "required" with parallel calls: an array of calls, each valid for its function (the random
    model may run out of tokens inside a later one: only then may the last be cut short)."""
    for seed in range(2):
        result = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=MAX_TOKENS,
            seed=seed,
        )
        choice = result.choices[0]
        calls = function_calls(choice.message)
        assert choice.finish_reason in ("tool_calls", "length") and calls
        assert_valid(calls if choice.finish_reason == "tool_calls" else calls[:-1])


def test_named_function(client: openai.OpenAI) -> None:
    """A named function: one call of it, valid arguments, finish_reason stop (as vLLM gives it)."""
    for seed in range(3):
        named = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=WEATHER_CHOICE,
            max_tokens=MAX_TOKENS,
            seed=seed,
        )
        calls = function_calls(named.choices[0].message)
        assert [name for name, _ in calls] == ["get_weather"] and named.choices[0].finish_reason == "stop"
        assert_valid(calls)


@pytest.mark.parametrize("tool_choice", ["required", WEATHER_CHOICE])
def test_streamed_calls_reassemble_to_the_whole_response(client: openai.OpenAI, tool_choice: Any) -> None:
    """Greedy, streamed and whole: the deltas (first with id, type and name, then the arguments) join to the
    same calls and finish reason."""
    kwargs: Any = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice}
    kwargs["parallel_tool_calls"] = False
    whole = client.chat.completions.create(**kwargs, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.chat.completions.create(**kwargs, max_tokens=MAX_TOKENS, temperature=0, stream=True))
    content, calls, ids, finish = reassemble(chunks)
    assert (content, calls, finish) == (
        None,
        function_calls(whole.choices[0].message),
        whole.choices[0].finish_reason,
    )
    assert_valid(calls)
    # How many argument fragments arrive depends on how fast this client reads (unread snapshots merge): the
    # scripted engine's paced test in test_api_tools checks that arguments stream in fragments.
    assert len(set(ids)) == len(ids)


def test_auto_parses_a_call_the_model_was_made_to_write(client: openai.OpenAI) -> None:
    """Auto with the hermes parser: a structured-output choice makes the random model write a hermes call, which
    comes back as a tool call, whole and streamed; a plain answer stays content."""
    extra = {"structured_outputs": {"choice": [HERMES_CALL + "</tool_call>"]}}
    kwargs: Any = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": 200,
        "extra_body": extra,
    }
    whole = client.chat.completions.create(**kwargs)
    expected = [("get_weather", '{"city": "paris", "unit": "celsius", "days": 2}')]
    assert function_calls(whole.choices[0].message) == expected
    assert whole.choices[0].finish_reason == "tool_calls" and not whole.choices[0].message.content
    assert reassemble(list(client.chat.completions.create(**kwargs, stream=True)))[1:4:2] == (
        expected,
        "tool_calls",
    )
    plain: Any = {**kwargs, "extra_body": {"structured_outputs": {"choice": ["sunny and warm"]}}}
    answer = client.chat.completions.create(**plain)
    assert answer.choices[0].message.content == "sunny and warm" and not answer.choices[0].message.tool_calls


def test_none_and_tool_history(client: openai.OpenAI) -> None:
    """tool_choice "none" gives plain content; a history with an assistant's calls (content null) and the tool's
    answer renders and serves."""
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    history: Any = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "chatcmpl-tool-1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "paris", "unit": "celsius", "days": 1}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice=WEATHER_CHOICE, max_tokens=MAX_TOKENS
    )
    assert_valid(function_calls(reply.choices[0].message))


def test_bad_tool_requests_are_400_then_a_good_one_succeeds(client: openai.OpenAI) -> None:
    """Unknown named function, tool_choice without tools, non-object or invalid parameters: 400s naming the
    field, each followed by a request that succeeds."""
    bad_schema: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    not_object: Any = [{"type": "function", "function": {"name": "f", "parameters": ["x"]}}]
    unknown: Any = {"type": "function", "function": {"name": "nope"}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": TOOLS, "tool_choice": unknown}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": not_object, "tool_choice": "none"}, "tools"),
        ({"tools": bad_schema, "tool_choice": "required"}, "tools"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kwargs)
        assert cast(Any, error.value.body)["param"] == param, kwargs
        assert_good_request(client)
