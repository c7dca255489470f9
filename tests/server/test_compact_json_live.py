"""Compact JSON where a grammar forces it (issue 26): forced tool-call arguments and response_format json_schema
allow no whitespace runs outside strings by default, so output cut short by max_tokens is still a JSON prefix;
`--no-disable-any-whitespace` restores the free-whitespace grammar. A tiny random model loves whitespace."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jiter
import openai
import pytest
from api_cases import MODEL
from pagoda.server.testing import make_tiny_model
from pydantic import BaseModel, ConfigDict, Field
from test_api_live import LiveServer, serving, sync_client

NUM_CALLS = 20


class City(BaseModel):
    """Arguments with a string, an enum and an integer."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z]{1,8}$")
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": City.model_json_schema()}}
]
CHOICE: Any = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES: Any = [{"role": "user", "content": "weather?"}]


def whitespace_outside_strings(text: str) -> list[str]:
    """Every whitespace run outside JSON strings, except the single spaces of `, ` and `: `."""
    runs: list[str] = []
    in_string = escaped = False
    run = ""
    previous = ""
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char in " \t\r\n":
            run += char
            continue
        elif char == '"':
            in_string = True
        if run and not (run == " " and previous in ",:"):
            runs.append(run)
        run = ""
        previous = char
    if run and not (run == " " and previous in ",:"):
        runs.append(run)
    return runs


def forced_arguments(client: openai.OpenAI) -> list[str]:
    """The arguments of NUM_CALLS named tool calls, sampled, cut short by max_tokens of 4 to 23."""
    found: list[str] = []
    for i in range(NUM_CALLS):
        result = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=CHOICE,
            max_tokens=4 + i,
            temperature=1.0,
            seed=i,
        )
        (call,) = result.choices[0].message.tool_calls or []
        found.append(call.function.arguments)  # type: ignore[union-attr]
    return found


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def compact(model_dir: Path) -> Iterator[LiveServer]:
    """A server with the default: compact forced JSON."""
    with serving(model_dir, "--max-model-len", "2048") as server:
        yield server


def test_forced_calls_cut_short_parse_as_json_prefixes(compact: LiveServer) -> None:
    """20 forced calls cut by max_tokens: each arguments text parses as a JSON prefix, with no whitespace run."""
    arguments = forced_arguments(sync_client(compact))
    for text in arguments:
        assert text.startswith("{"), text
        assert whitespace_outside_strings(text) == [], text
        parsed = jiter.from_json(text.encode(), partial_mode="trailing-strings")
        assert isinstance(parsed, dict), text


def test_response_format_schema_is_compact(compact: LiveServer) -> None:
    """response_format json_schema (chat) and text.format (responses): no whitespace runs either."""
    client = sync_client(compact)
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": City.model_json_schema()},
    }
    for i in range(4):
        chat = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, response_format=response_format, max_tokens=8 + 4 * i, seed=i
        )
        text = chat.choices[0].message.content or ""
        assert whitespace_outside_strings(text) == [], text
        jiter.from_json(text.encode(), partial_mode="trailing-strings")
    fmt: Any = {"type": "json_schema", "name": "city", "schema": City.model_json_schema()}
    response = client.responses.create(model=MODEL, input="city", text={"format": fmt}, max_output_tokens=12)
    assert whitespace_outside_strings(response.output_text) == [], response.output_text


def test_opting_out_restores_free_whitespace(model_dir: Path) -> None:
    """--no-disable-any-whitespace: the old grammar, under which the tiny model writes whitespace runs; a
    request's structured_outputs.disable_any_whitespace still asks for compact JSON."""
    with serving(model_dir, "--max-model-len", "2048", "--no-disable-any-whitespace") as server:
        client = sync_client(server)
        arguments = forced_arguments(client)
        assert any(whitespace_outside_strings(text) for text in arguments), arguments
        extra = {"structured_outputs": {"json": City.model_json_schema(), "disable_any_whitespace": True}}
        for i in range(4):
            chat = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=12 + 4 * i, seed=i, extra_body=extra
            )
            text = chat.choices[0].message.content or ""
            assert whitespace_outside_strings(text) == [], text


def test_whitespace_scan() -> None:
    """The checker itself: strings are skipped, `, ` and `: ` are allowed, anything else is a run."""
    assert whitespace_outside_strings('{"a b  c": 1, "d":[2]}') == []
    assert whitespace_outside_strings('{"a":  1}') == ["  "]
    assert whitespace_outside_strings('{\n"a":1}') == ["\n"]
    assert whitespace_outside_strings('{"a\\"  ": 1 }') == [" "]
