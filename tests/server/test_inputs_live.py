"""Hostile request inputs against a real `pagoda serve` with its default limits (issue 43 items 9, 10, 14):
backtracking regexes and patterns, malformed tool-schema patterns, oversized or deep `chat_template_kwargs`, and a
120,000-character regex. Each is a bounded answer or a 400 naming the field, and the server keeps serving."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pagoda.server.api.template_kwargs import MAX_TEMPLATE_KWARGS_CHARS
from pagoda.server.cli_args import build_parser, serve_config
from pagoda.server.testing.serve import LiveServer
from pagoda.server.testing.tiny_models import make_tiny_model

# The default --grammar-compile-timeout (issue 43 item 14): every constraint answers within it.
COMPILE_DEADLINE_S = 5.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One tiny-model server with the default limits, for the module."""
    model = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "model")
    with LiveServer(model, ["--dtype", "float32", "--kv-cache-gib", "0.05"]) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    """An HTTP client on the server, knowing its model id."""
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def _chat(http: httpx.Client, **extra: Any) -> tuple[httpx.Response, float]:
    model = http.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}
    started = time.monotonic()
    response = http.post("/v1/chat/completions", json=body)
    return response, time.monotonic() - started


def _assert_400(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    message: str = error["message"]
    return message


def _assert_serving(http: httpx.Client) -> None:
    response, _ = _chat(http)
    assert response.status_code == 200, response.text


_BACKTRACKING = ["(a+)+$", "(a|aa)*c", "(a*)*b", "^(([a-z])+.)+[A-Z]([a-z])+$"]


@pytest.mark.parametrize("pattern", _BACKTRACKING)
def test_backtracking_regex_answers_within_the_deadline(http: httpx.Client, pattern: str) -> None:
    """A ReDoS-shaped regex, as structured_outputs.regex and as a JSON-schema `pattern`: answered within the
    compile deadline (xgrammar compiles to an automaton, it never backtracks), and the server serves on."""
    response, took = _chat(http, structured_outputs={"regex": pattern})
    assert response.status_code == 200 and took < COMPILE_DEADLINE_S, (response.text, took)
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": pattern}},
        "required": ["s"],
    }
    response, took = _chat(
        http, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    assert response.status_code in (200, 400) and took < COMPILE_DEADLINE_S, (response.text, took)
    _assert_serving(http)


@pytest.mark.parametrize(
    "choice",
    ["required", "auto", {"type": "function", "function": {"name": "f"}}],
    ids=["required", "auto", "named"],
)
def test_malformed_pattern_in_a_tool_schema_is_400(http: httpx.Client, choice: object) -> None:
    """A tool whose parameter schema has an unparsable `pattern` is a 400 naming `tools`, never a crash."""
    parameters = {
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": "[a-("}},
        "required": ["a"],
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    message = _assert_400(_chat(http, tools=[tool], tool_choice=choice)[0], "tools")
    assert "tools.0.function.parameters" in message
    _assert_serving(http)


def test_chat_template_kwargs_megabyte_value_is_400(http: httpx.Client) -> None:
    """A megabyte variable is refused before the template renders it."""
    message = _assert_400(_chat(http, chat_template_kwargs={"x": "a" * 1_000_000})[0], "chat_template_kwargs")
    assert f"at most {MAX_TEMPLATE_KWARGS_CHARS} characters" in message
    _assert_serving(http)


def test_chat_template_kwargs_deep_or_many_are_400(http: httpx.Client) -> None:
    """200 levels of nesting (the body parser takes it) and 10,000 variables are 400s with short messages."""
    model = http.get("/v1/models").json()["data"][0]["id"]
    deep = '{"a":' * 200 + "1" + "}" * 200
    head = json.dumps({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    response = http.post(
        "/v1/chat/completions",
        content=(head[:-1] + ', "chat_template_kwargs": {"x": ' + deep + "}}").encode(),
        headers={"content-type": "application/json"},
    )
    message = _assert_400(response, "chat_template_kwargs")
    assert "nest deeper" in message and len(message) < 300
    many = {f"k{i}": i for i in range(10_000)}
    assert "variables" in _assert_400(_chat(http, chat_template_kwargs=many)[0], "chat_template_kwargs")
    assert (
        _chat(http, chat_template_kwargs={"enable_thinking": False, "opts": {"a": [1, {"b": 2}]}})[
            0
        ].status_code
        == 200
    )


def test_a_120k_character_regex_is_refused_at_once(http: httpx.Client) -> None:
    """Under the default --max-grammar-chars a 120,000-character regex (20 s of compiling against a 49k
    vocabulary) is a 400 naming the field, before any compile."""
    response, took = _chat(http, structured_outputs={"regex": "[a-z]" * 24_000})
    message = _assert_400(response, "structured_outputs.regex")
    assert "--max-grammar-chars (16384)" in message and took < 2.0
    _assert_serving(http)


def test_deadline_defaults_bound_a_public_server() -> None:
    """The defaults (issue 43 item 14): a body within 60 s however it trickles, a compile within 5 s, 16 Ki
    characters of constraint."""
    config = serve_config(build_parser().parse_args(["serve", str(Path("m"))]))
    assert config.server.limits.body_deadline == 60.0
    assert (config.app.grammar_compile_timeout, config.app.max_grammar_chars) == (5.0, 16 * 1024)
