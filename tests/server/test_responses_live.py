"""/v1/responses (issue 26) through the live server on a tiny random-weight model and the official openai client:
`responses.parse` with a schema, forced function calls, and a greedy stream equal to the whole response."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from api_cases import MODEL
from pagoda.server.cli import main
from pagoda.server.cli_args import build_parser, serve_config
from pagoda.server.testing import make_tiny_model
from test_api_live import LiveServer, serving, sync_client
from test_compact_json_live import City  # the bounded object both tests force

TOOLS: Any = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": City.model_json_schema(),
        "strict": True,
    }
]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server over a tiny random Llama."""
    path = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=4096)
    with serving(path, "--max-model-len", "2048", "--max-stored-responses", "8") as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    """The official synchronous OpenAI client."""
    return sync_client(live)


def test_parse_with_a_schema(client: openai.OpenAI) -> None:
    """text.format json_schema goes through the structured-output seam: responses.parse gives the model."""
    response = client.responses.parse(
        model=MODEL, input="a city", text_format=City, max_output_tokens=200, temperature=1.0
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, City)


def test_forced_function_call(client: openai.OpenAI) -> None:
    """A named tool_choice gives one function_call item whose arguments validate; required (one call) too."""
    choices: list[Any] = [{"type": "function", "name": "get_weather"}, "required"]
    for choice in choices:
        response = client.responses.create(
            model=MODEL,
            input="weather?",
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            max_output_tokens=400,
        )
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls and all(call.name == "get_weather" for call in calls), response.output
        for call in calls:
            assert response.status == "completed", response
            City.model_validate_json(call.arguments)


def test_greedy_stream_equals_the_whole_response(client: openai.OpenAI) -> None:
    """Greedy: the streamed deltas, the completed event and the retrieved response all equal the whole one; the
    stored conversation continues with previous_response_id."""
    whole = client.responses.create(model=MODEL, input="tell me", temperature=0.0, max_output_tokens=24)
    with client.responses.stream(
        model=MODEL, input="tell me", temperature=0.0, max_output_tokens=24
    ) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # Cut by max_output_tokens, the stream ends with response.incomplete (as OpenAI's), which the client's
    # get_final_response does not take: read its response.
    last = events[-1]
    assert last.type == whole_event_type(whole.status)
    final = last.response  # type: ignore[union-attr]
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == whole.output_text
    follow = client.responses.create(
        model=MODEL, input="more", previous_response_id=whole.id, temperature=0.0, max_output_tokens=4
    )
    assert follow.usage is not None and whole.usage is not None
    # The continued prompt holds the first turn and its answer: longer than both.
    assert follow.usage.input_tokens > whole.usage.input_tokens + whole.usage.output_tokens
    # The prefix cache serves the earlier turn again.
    assert follow.usage.input_tokens_details.cached_tokens > 0
    assert json.loads(whole.model_dump_json())["object"] == "response"


def whole_event_type(status: str | None) -> str:
    """The last event of a stream whose whole response has this status."""
    return "response.completed" if status == "completed" else "response.incomplete"


def test_max_stored_responses_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """The flag reaches AppSettings; a negative bound exits 2 naming it."""
    config = serve_config(build_parser().parse_args(["serve", "m", "--max-stored-responses", "5"]))
    assert config.app.max_stored_responses == 5
    assert main(["serve", "unused-model", "--max-stored-responses", "-1"]) == 2
    assert "max-stored-responses" in capsys.readouterr().err
