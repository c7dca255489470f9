"""Anthropic's Messages API (issue 42): /v1/messages and /v1/messages/count_tokens driven by the official
`anthropic` client against a live tiny random-weight server (one per module, with an API key and no tool-call
parser), raw HTTP for the errors, and the fake engine for thinking blocks, auto tool calls, pings and aborts."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from api_cases import MODEL
from api_fake_engine import FAIL_STEP_MARKER, LETTERS, FakeEngine, _Req, _Seq, serve_in_thread
from pagoda.server.api import AppSettings
from pagoda.server.api.anthropic_errors import error_body, error_response
from pagoda.server.api.anthropic_input import translate
from pagoda.server.api.anthropic_protocol import MessagesRequest
from pagoda.server.api.errors import APIError
from pagoda.server.testing import make_tiny_model
from test_api_live import LiveServer, serving
from test_compact_json_live import City  # a bounded object: a random model closes it within MAX_TOOL_TOKENS

KEY = "sk-anthropic-test"
GREEDY: dict[str, Any] = {"temperature": 0.0}  # the installed client takes sampling fields as extra_body
MAX_TOOL_TOKENS = 400  # room for a schema-bounded City object to close (each test checks the stop reason)
TOOLS: Any = [
    {"name": "get_weather", "description": "The weather in a city.", "input_schema": City.model_json_schema()}
]
SYSTEM = "You are a terse assistant."
TURNS: Any = [
    {"role": "user", "content": "Hello world!"},
    {"role": "assistant", "content": "Hi. How are you today?"},
    {"role": "user", "content": [{"type": "text", "text": "The capital of France is"}]},
]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server over a tiny random Llama with an API key and no --tool-call-parser."""
    path = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=4096)
    with serving(path, "--max-model-len", "2048", "--api-key", KEY) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> anthropic.Anthropic:
    """The official Anthropic client (no retries)."""
    return anthropic.Anthropic(base_url=live.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(live: LiveServer) -> openai.OpenAI:
    """The official OpenAI client of the same server."""
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(
    live: LiveServer, body: dict[str, Any], path: str = "/v1/messages", **headers: str
) -> httpx.Response:
    """A raw POST with the key in x-api-key (Anthropic's header) unless `headers` say otherwise."""
    sent = {"content-type": "application/json", **(headers or {"x-api-key": KEY})}
    content = json.dumps(body).encode()  # ASCII escapes: a lone surrogate goes out as `\ud800`
    return httpx.post(live.base_url + path, content=content, headers=sent, timeout=120)


def assert_anthropic_error(response: httpx.Response, status: int, error_type: str, *named: str) -> str:
    """The response is `status` with Anthropic's error body of `error_type` whose message names `named`."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert body["error"]["type"] == error_type, body
    message: str = body["error"]["message"]
    for word in named:
        assert word in message, (word, message)
    return message


def assert_serves(client: anthropic.Anthropic) -> None:
    """The server still serves after a bad request."""
    message = client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "ok"}])
    assert message.usage.output_tokens >= 1


def text_of(message: Any) -> str:
    """The text blocks of a message, joined."""
    return "".join(block.text for block in message.content if block.type == "text")


def test_greedy_text_and_usage_equal_chat_completions(
    client: anthropic.Anthropic, chat: openai.OpenAI
) -> None:
    """A system prompt and three turns, greedy: the text, the output tokens and the prompt tokens equal
    /v1/chat/completions' with the system prompt as its first message; the stop reason maps its finish reason;
    the same request again reads its prompt from the prefix cache (cache_read_input_tokens, Anthropic's split)."""
    message = client.messages.create(
        model=MODEL,
        max_tokens=12,
        system=SYSTEM,
        messages=TURNS,
        metadata={"user_id": "u1"},
        extra_body=GREEDY,
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    completion = chat.chat.completions.create(
        model=MODEL,
        max_tokens=12,
        temperature=0.0,
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Hello world!"},
            {"role": "assistant", "content": "Hi. How are you today?"},
            {"role": "user", "content": "The capital of France is"},
        ],
    )
    choice = completion.choices[0]
    assert text_of(message) == choice.message.content
    assert completion.usage is not None
    usage = message.usage
    assert usage.output_tokens == completion.usage.completion_tokens
    assert (usage.input_tokens + (usage.cache_read_input_tokens or 0)) == completion.usage.prompt_tokens
    assert usage.cache_creation_input_tokens == 0
    expected = {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
    assert message.stop_reason == expected and message.stop_sequence is None
    again = client.messages.create(
        model=MODEL, max_tokens=12, system=SYSTEM, messages=TURNS, extra_body=GREEDY
    )
    assert text_of(again) == text_of(message)
    cached = again.usage.cache_read_input_tokens or 0
    assert cached >= 16  # a full block of 16 at least: the prompt is longer than 2 blocks
    assert again.usage.input_tokens + cached == completion.usage.prompt_tokens


def test_system_blocks_equal_the_joined_string(client: anthropic.Anthropic) -> None:
    """`system` as text blocks is the blocks' text joined by newlines (as chat joins text parts)."""
    turns: Any = [{"role": "user", "content": "hi"}]
    blocks: Any = [
        {"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "two"},
    ]
    as_blocks = client.messages.count_tokens(model=MODEL, system=blocks, messages=turns)
    as_string = client.messages.count_tokens(model=MODEL, system="one\ntwo", messages=turns)
    assert as_blocks.input_tokens == as_string.input_tokens > 0


def test_count_tokens_equals_input_tokens(client: anthropic.Anthropic) -> None:
    """count_tokens of a request equals the input tokens /v1/messages then reports for it (a prompt never sent
    before, so nothing of it is cached: its first block differs from every other test's)."""
    system = "zq7 unique count_tokens prompt, never sent before"
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=TURNS, tools=TOOLS)
    message = client.messages.create(
        model=MODEL, max_tokens=1, system=system, messages=TURNS, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert message.usage.cache_read_input_tokens == 0
    assert counted.input_tokens == message.usage.input_tokens > 0


def test_streaming_event_sequence(live: LiveServer, client: anthropic.Anthropic) -> None:
    """The raw stream: message_start, ping, content_block_start / deltas / stop with one index, message_delta
    (stop reason, usage), message_stop, every event's `type` its name; the client's accumulated message equals
    the non-streamed one (greedy)."""
    body = {"model": MODEL, "max_tokens": 10, "system": SYSTEM, "messages": TURNS, "stream": True, **GREEDY}
    with httpx.stream(
        "POST", f"{live.base_url}/v1/messages", json=body, headers={"x-api-key": KEY}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = parse_events(response.read().decode())
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    blocks = [name for name in names if name.startswith("content_block")]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    assert set(blocks[1:-1]) == {"content_block_delta"}
    assert {data["index"] for name, data in events if name.startswith("content_block")} == {0}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    delta = events[-2][1]
    streamed = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    whole = client.messages.create(
        model=MODEL, max_tokens=10, system=SYSTEM, messages=TURNS, extra_body=GREEDY
    )
    assert streamed == text_of(whole)
    assert delta["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    with client.messages.stream(
        model=MODEL, max_tokens=10, system=SYSTEM, messages=TURNS, extra_body=GREEDY
    ) as stream:
        final = stream.get_final_message()
    assert text_of(final) == text_of(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    total = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert total == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


def parse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The (event name, data) pairs of a server-sent event stream."""
    events: list[tuple[str, dict[str, Any]]] = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_stop_sequence_and_max_tokens(client: anthropic.Anthropic) -> None:
    """A stop sequence taken from the greedy text ends it there (stop_reason stop_sequence, the sequence named,
    not in the text), streamed or not; a smaller max_tokens ends it with max_tokens."""
    turns: Any = [{"role": "user", "content": "Tell me about tokens, blocks and slots."}]
    full = text_of(client.messages.create(model=MODEL, max_tokens=24, messages=turns, extra_body=GREEDY))
    assert len(full) >= 8, full  # this seeded model writes more than 8 characters here
    sequence = full[4:6]
    expected = full[: full.index(sequence)]
    stopped = client.messages.create(
        model=MODEL, max_tokens=24, messages=turns, stop_sequences=["@@never@@", sequence], extra_body=GREEDY
    )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", sequence)
    assert text_of(stopped) == expected
    with client.messages.stream(
        model=MODEL, max_tokens=24, messages=turns, stop_sequences=[sequence], extra_body=GREEDY
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == ("stop_sequence", sequence, expected)
    cut = client.messages.create(model=MODEL, max_tokens=2, messages=turns, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    # vLLM's extras, as on /v1/responses: ignore_eos and seed reach the sampler.
    extras = {"ignore_eos": True, "seed": 7, "min_p": 0.05, "repetition_penalty": 1.1, "priority": 1}
    seeded = [
        client.messages.create(model=MODEL, max_tokens=20, messages=turns, extra_body=extras)
        for _ in range(2)
    ]
    assert all(m.usage.output_tokens == 20 and m.stop_reason == "max_tokens" for m in seeded)
    assert text_of(seeded[0]) == text_of(seeded[1])
    sampled = client.messages.create(
        model=MODEL, max_tokens=2, messages=turns, extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 20}
    )
    assert sampled.usage.output_tokens <= 2


def tool_uses(message: Any) -> list[Any]:
    """The tool_use blocks of a message."""
    return [block for block in message.content if block.type == "tool_use"]


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "any", "disable_parallel_tool_use": True},
        {"type": "tool", "name": "get_weather"},
        {"type": "any"},
    ],
)
def test_forced_tool_use_validates_without_a_parser(client: anthropic.Anthropic, choice: Any) -> None:
    """tool_choice any and {type: tool} on a server without --tool-call-parser: the grammar forces tool_use
    blocks whose input validates against the schema (random weights: only the grammar makes it so), stop
    reason tool_use, streamed too; disable_parallel_tool_use or a named tool gives exactly one."""
    message = client.messages.create(
        model=MODEL,
        max_tokens=MAX_TOOL_TOKENS,
        messages=TURNS,
        tools=TOOLS,
        tool_choice=choice,
        extra_body=GREEDY,
    )
    uses = tool_uses(message)
    assert message.stop_reason == "tool_use", message
    assert uses and all(use.name == "get_weather" and use.id.startswith("toolu_") for use in uses)
    for use in uses:
        City.model_validate(use.input)
    if choice != {"type": "any"}:
        assert len(uses) == 1 and text_of(message) == ""
    with client.messages.stream(
        model=MODEL,
        max_tokens=MAX_TOOL_TOKENS,
        messages=TURNS,
        tools=TOOLS,
        tool_choice=choice,
        extra_body=GREEDY,
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(use.name, use.input) for use in tool_uses(final)] == [(use.name, use.input) for use in uses]


def test_tool_result_round_trip(live: LiveServer, client: anthropic.Anthropic) -> None:
    """A forced call, then its result in the next user turn (the assistant turn sent back as the client gives
    it): the conversation is served and counted; a result answering no call is a 400 naming its id."""
    first = client.messages.create(
        model=MODEL,
        max_tokens=MAX_TOOL_TOKENS,
        messages=TURNS,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    (use,) = tool_uses(first)
    result: Any = {
        "type": "tool_result",
        "tool_use_id": use.id,
        "content": [{"type": "text", "text": "sunny, 21 C"}],
    }
    turns: Any = [
        *TURNS,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [result]},
    ]
    second = client.messages.create(
        model=MODEL, max_tokens=4, messages=turns, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert second.usage.output_tokens >= 1 and not tool_uses(second)
    counted = client.messages.count_tokens(model=MODEL, messages=turns, tools=TOOLS)
    assert counted.input_tokens == second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0)
    # The result is in the prompt: a longer one makes it longer, an error result reads as one.
    longer: Any = [
        *turns[:-1],
        {"role": "user", "content": [{**result, "content": "sunny, 21 C, light wind"}]},
    ]
    errored: Any = [*turns[:-1], {"role": "user", "content": [{**result, "is_error": True}]}]
    for other in (longer, errored):
        assert (
            client.messages.count_tokens(model=MODEL, messages=other, tools=TOOLS).input_tokens
            > counted.input_tokens
        )
    # As a client may send it back by hand: every field of the client's blocks, nulls included.
    sent_back = {"role": "assistant", "content": [block.model_dump() for block in first.content]}
    dumped: Any = [*TURNS, sent_back, turns[-1]]
    assert post(live, {"model": MODEL, "max_tokens": 1, "messages": dumped}).status_code == 200
    orphan = [*TURNS, sent_back, {"role": "user", "content": [{**result, "tool_use_id": "toolu_nobody"}]}]
    response = post(live, {"model": MODEL, "max_tokens": 4, "messages": orphan})
    assert_anthropic_error(
        response, 400, "invalid_request_error", "messages.4.content.0.tool_use_id", "toolu_nobody"
    )


def test_output_config_format_enforces_the_schema(client: anthropic.Anthropic) -> None:
    """output_config.format json_schema goes through the structured-output seam: the text validates."""
    schema: Any = City.model_json_schema()
    message = client.messages.create(
        model=MODEL,
        max_tokens=MAX_TOOL_TOKENS,
        messages=TURNS,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert message.stop_reason == "end_turn", message
    City.model_validate_json(text_of(message))


def test_auth_by_x_api_key_and_bearer(live: LiveServer) -> None:
    """x-api-key and Authorization: Bearer both pass; a missing or wrong key is a 401 in Anthropic's shape,
    from raw HTTP and through the client."""
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    assert post(live, body, **{"x-api-key": KEY}).status_code == 200
    assert post(live, body, authorization=f"Bearer {KEY}").status_code == 200
    for headers in (
        {"x-api-key": "wrong"},
        {"authorization": "Bearer wrong"},
        {"anthropic-version": "2023-06-01"},
    ):
        response = post(live, body, **headers)
        assert_anthropic_error(response, 401, "authentication_error", "API key")
        counted = post(live, body, "/v1/messages/count_tokens", **headers)
        assert_anthropic_error(counted, 401, "authentication_error")
    wrong = anthropic.Anthropic(base_url=live.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Missing or invalid API key."},
    }


BASE: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
IMAGE: Any = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
}
BAD_BODIES: list[tuple[dict[str, Any], tuple[str, ...]]] = [
    ({"model": MODEL, "messages": BASE["messages"]}, ("max_tokens", "required")),
    ({**BASE, "max_tokens": 0}, ("max_tokens",)),
    ({**BASE, "messages": [{"role": "tool", "content": "hi"}]}, ("messages.0.role",)),
    (
        {**BASE, "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
        ("messages.0.content.0.type", "video"),
    ),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, ("messages.0.content.0.text",)),
    (
        {**BASE, "messages": [{"role": "user", "content": [{"type": ["text"]}]}]},
        ("messages.0.content.0.type",),
    ),
    (
        {
            **BASE,
            "messages": [
                {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
            ],
        },
        ("messages.0.content.0.type", "user message"),
    ),
    ({**BASE, "messages": [{"role": "user", "content": [IMAGE]}]}, ("messages", "does not take images")),
    ({**BASE, "messages": [{"role": "user", "content": []}]}, ("messages.0.content",)),
    ({**BASE, "messages": []}, ("messages",)),
    (
        {**BASE, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]},
        ("messages.1.role", "prefill"),
    ),
    ({**BASE, "temperature": 1.5}, ("temperature",)),
    ({**BASE, "temperature": -0.1}, ("temperature",)),
    ({**BASE, "temperature": "hot"}, ("temperature",)),
    ({**BASE, "top_p": 0.0}, ("top_p",)),
    ({**BASE, "top_k": 0}, ("top_k",)),
    ({**BASE, "stop_sequences": "END"}, ("stop_sequences",)),
    ({**BASE, "frequency_penalty": 1.0}, ("frequency_penalty",)),
    ({**BASE, "system": [{"type": "image"}]}, ("system.0.type",)),
    ({**BASE, "tool_choice": {"type": "any"}}, ("tool_choice",)),
    ({**BASE, "tools": TOOLS}, ("tool_choice", "--tool-call-parser")),  # auto needs the flags, as on chat
    ({**BASE, "tools": TOOLS, "tool_choice": {"type": "tool"}}, ("tool_choice.name",)),
    ({**BASE, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, ("tool_choice", "nope")),
    (
        {**BASE, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        ("tools.0.type", "web_search_20250305"),
    ),
    ({**BASE, "tools": [{"name": "f", "input_schema": {"type": "string"}}]}, ("tools.0.input_schema.type",)),
    (
        {**BASE, "tools": [{"name": "f", "input_schema": {"type": "object"}, "defer_loading": True}]},
        ("tools.0.defer_loading",),
    ),
    ({**BASE, "tools": [*TOOLS, *TOOLS], "tool_choice": {"type": "any"}}, ("tools.1.name", "unique")),
    ({**BASE, "thinking": {"type": "enabled", "budget_tokens": 2048}}, ("thinking.budget_tokens",)),
    ({**BASE, "output_config": {"effort": "high"}}, ("output_config.effort",)),
    ({**BASE, "speed": "fast"}, ("speed",)),
    ({**BASE, "max_tokens": 4096}, ("max_tokens", "max_model_len")),
    ({**BASE, "unknown_field": 1}, ("unknown_field",)),
    ({**BASE, "messages": [{"role": "user", "content": "\ud800"}]}, ("messages.0.content", "surrogate")),
]


@pytest.mark.parametrize(("body", "named"), BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_requests_are_400_naming_the_field(
    live: LiveServer, client: anthropic.Anthropic, body: dict[str, Any], named: tuple[str, ...]
) -> None:
    """Each bad body is a 400 invalid_request_error whose message names the field; the server keeps serving."""
    assert_anthropic_error(post(live, body), 400, "invalid_request_error", *named)
    assert_serves(client)


def test_other_errors_take_anthropics_shape(live: LiveServer, client: anthropic.Anthropic) -> None:
    """An unknown model is a 404 not_found_error (the client's NotFoundError); bad JSON, a wrong content type
    and bad count_tokens bodies are 400s in Anthropic's shape; the OpenAI routes keep OpenAI's shape."""
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(
            model="claude-nope", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "model: The model `claude-nope` does not exist."},
    }
    raw = httpx.post(
        f"{live.base_url}/v1/messages",
        content=b"{",
        headers={"x-api-key": KEY, "content-type": "application/json"},
    )
    assert_anthropic_error(raw, 400, "invalid_request_error", "JSON")
    typed = httpx.post(f"{live.base_url}/v1/messages", content=b"{}", headers={"x-api-key": KEY})
    assert_anthropic_error(typed, 400, "invalid_request_error", "Content-Type")
    counted = post(live, {**BASE}, "/v1/messages/count_tokens")
    assert_anthropic_error(counted, 400, "invalid_request_error", "max_tokens")  # not a count_tokens field
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [IMAGE]}])
    missing = httpx.post(f"{live.base_url}/v1/messages/nope", json={}, headers={"x-api-key": KEY})
    assert_anthropic_error(missing, 404, "not_found_error")
    chat = httpx.post(f"{live.base_url}/v1/chat/completions", json={}, headers={"x-api-key": KEY})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert_serves(client)


def test_translation_into_chat_messages() -> None:
    """The one translation: the system prompt leads, consecutive turns of a role are combined, a tool_use is a
    call of its assistant message, each tool_result a tool message in order (an error result marked), thinking
    left out, sampling fields and tool_choice mapped onto chat's."""
    body = MessagesRequest.model_validate(
        {
            "model": MODEL,
            "max_tokens": 8,
            "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "messages": [
                {"role": "user", "content": "one"},
                {"role": "user", "content": [{"type": "text", "text": "two"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": ""},
                        {"type": "text", "text": "calling"},
                        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
                        {"type": "tool_use", "id": "toolu_2", "name": "f", "input": {"x": 2}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "r1"},
                        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "bad", "is_error": True},
                        {"type": "text", "text": "so?"},
                    ],
                },
            ],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "temperature": 0.5,
            "top_k": 4,
        }
    )
    chat = translate(body).chat
    got = [
        (
            m.role,
            m.content if isinstance(m.content, str | None) else [getattr(p, "text", None) for p in m.content],
        )
        for m in chat.messages
    ]
    assert got == [
        ("system", "a\nb"),
        ("user", ["one", "two"]),
        ("assistant", "calling"),
        ("tool", "r1"),
        ("tool", "Error: bad"),
        ("user", "so?"),
    ]
    calls = chat.messages[2].tool_calls or []
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("toolu_1", "f", {"x": 1}),
        ("toolu_2", "f", {"x": 2}),
    ]
    assert [m.tool_call_id for m in chat.messages[3:5]] == ["toolu_1", "toolu_2"]
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.stop) == ("required", False, ["END"])
    assert (chat.temperature, chat.top_k, chat.max_tokens) == (0.5, 4, None)
    assert chat.tools is not None and chat.tools[0].function.parameters == {"type": "object"}


@pytest.mark.parametrize(
    ("status", "sent", "error_type"),
    [
        (400, 400, "invalid_request_error"),
        (401, 401, "authentication_error"),
        (403, 403, "permission_error"),
        (404, 404, "not_found_error"),
        (405, 405, "invalid_request_error"),
        (413, 413, "request_too_large"),
        (429, 429, "rate_limit_error"),
        (500, 500, "api_error"),
        (503, 529, "overloaded_error"),
    ],
)
def test_error_types_by_status(status: int, sent: int, error_type: str) -> None:
    """Anthropic's error type of each status the server sends (a 503 goes out as 529, overloaded); a field
    the error names leads the message under its Anthropic name."""
    body = error_body(APIError(status, "went wrong"))
    assert body.model_dump() == {"type": "error", "error": {"type": error_type, "message": "went wrong"}}
    named = error_body(APIError(status, "too many", param="stop")).error.message
    assert named == "stop_sequences: too many"
    assert error_response(APIError(status, "x")).status_code == sent


# --- the fake engine: scripted outputs, a slow engine, a failing one -----------------------------------------


class ScriptEngine(FakeEngine):
    """The fake engine writing `script` one character per step (a token each), then stopping as eos would."""

    def __init__(self, script: str, **kwargs: Any) -> None:
        super().__init__(**{"step_seconds": 0.005, **kwargs})
        self.script = script

    def _advance(self, req: _Req, seq: _Seq) -> None:
        position = len(seq.token_ids)
        seq.token_ids.append(self._letter_ids[position % len(LETTERS)])  # the ids do not matter here
        seq.text += self.script[position]
        self.generation_tokens += 1
        if len(seq.token_ids) >= len(self.script):
            seq.finish_reason = "stop"
        elif len(seq.token_ids) >= req.params.max_tokens:
            seq.finish_reason = "length"


def fake_client(base_url: str) -> anthropic.Anthropic:
    """The Anthropic client of an in-process fake server (no key)."""
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=30)


HI: Any = [{"role": "user", "content": "q"}]


def test_thinking_blocks_with_a_reasoning_parser() -> None:
    """--reasoning-parser deepseek_r1: the think text is a thinking block before the text block, streamed and
    whole alike (thinking_delta events); thinking disabled leaves it all text; thinking blocks sent back are
    left out of the prompt."""
    settings = AppSettings(reasoning_parser="deepseek_r1")
    with serve_in_thread(ScriptEngine("let me see</think>the answer"), settings=settings) as running:
        client = fake_client(running.base_url)
        whole = client.messages.create(model=MODEL, max_tokens=64, messages=HI)
        assert [block.type for block in whole.content] == ["thinking", "text"]
        assert blocks_of(whole)[0] == ("thinking", "let me see", None) and text_of(whole) == "the answer"
        assert whole.stop_reason == "end_turn"
        with client.messages.stream(model=MODEL, max_tokens=64, messages=HI) as stream:
            kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
        assert blocks_of(final) == blocks_of(whole)
        assert (
            kinds[0] == "thinking_delta" and kinds[-1] == "text_delta" and kinds.count("thinking_delta") > 1
        )
        off = client.messages.create(model=MODEL, max_tokens=64, messages=HI, thinking={"type": "disabled"})
        assert [block.type for block in off.content] == ["text"]
        assert text_of(off) == "let me see</think>the answer"
        history: Any = [
            *HI,
            {"role": "assistant", "content": whole.content},
            {"role": "user", "content": "more"},
        ]
        without: Any = [
            *HI,
            {"role": "assistant", "content": "the answer"},
            {"role": "user", "content": "more"},
        ]
        counted = [
            client.messages.count_tokens(model=MODEL, messages=turns).input_tokens
            for turns in (history, without)
        ]
        assert counted[0] == counted[1]


def blocks_of(message: Any) -> list[tuple[str, str | None, str | None]]:
    """Each block's type, thinking and text."""
    return [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in message.content]


HERMES = '<tool_call>{"name": "get_weather", "arguments": {"name": "paris", "unit": "celsius", "days": 2}}</tool_call>'


def test_auto_tool_choice_with_a_parser() -> None:
    """--enable-auto-tool-choice --tool-call-parser hermes: a call the model writes is a tool_use block (its
    input the parsed arguments, stop reason tool_use), streamed as input_json_delta fragments that join to it."""
    settings = AppSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serve_in_thread(ScriptEngine("Sure." + HERMES, max_model_len=512), settings=settings) as running:
        client = fake_client(running.base_url)
        whole = client.messages.create(model=MODEL, max_tokens=256, messages=HI, tools=TOOLS)
        assert [block.type for block in whole.content] == ["text", "tool_use"]
        assert text_of(whole) == "Sure." and whole.stop_reason == "tool_use"
        (use,) = tool_uses(whole)
        assert use.input == {"name": "paris", "unit": "celsius", "days": 2}
        with client.messages.stream(model=MODEL, max_tokens=256, messages=HI, tools=TOOLS) as stream:
            fragments = [
                e.delta.partial_json
                for e in stream
                if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
            ]
            final = stream.get_final_message()
        assert len(fragments) > 1 and json.loads("".join(fragments)) == use.input
        assert tool_uses(final)[0].input == use.input and final.stop_reason == "tool_use"
        cut_at = len("Sure.") + HERMES.index('"unit"') + 3  # the output ends with `"paris", "un`
        cut = client.messages.create(model=MODEL, max_tokens=cut_at, messages=HI, tools=TOOLS)
        assert cut.stop_reason == "max_tokens"
        # Cut inside the arguments: the input is the object written so far, as the client parses the stream.
        assert tool_uses(cut)[0].input == {"name": "paris"}


def test_pings_keep_a_slow_stream_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing to send for PING_SECONDS the stream sends ping events (the client skips them)."""
    monkeypatch.setattr("pagoda.server.api.serving_messages.PING_SECONDS", 0.05)
    with serve_in_thread(ScriptEngine("abc", step_seconds=0.3)) as running:
        body = {"model": MODEL, "max_tokens": 8, "messages": HI, "stream": True}
        events = parse_events(httpx.post(f"{running.base_url}/v1/messages", json=body, timeout=30).text)
        names = [name for name, _ in events]
        first_delta = names.index("content_block_delta")
        assert names.count("ping") >= 3 and "ping" in names[first_delta:]
        assert names[0] == "message_start" and names[-1] == "message_stop"
        assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == "abc"
        with fake_client(running.base_url).messages.stream(model=MODEL, max_tokens=8, messages=HI) as stream:
            assert text_of(stream.get_final_message()) == "abc"


def test_a_client_leaving_mid_stream_aborts_the_request() -> None:
    """Closing the stream after its first delta aborts the engine request (its KV freed before the next step)."""
    engine = ScriptEngine("x" * 100, step_seconds=0.02)  # 2 s to write, if nobody aborts it
    with serve_in_thread(engine) as running:
        body = {"model": MODEL, "max_tokens": 100, "messages": HI, "stream": True}
        with httpx.stream("POST", f"{running.base_url}/v1/messages", json=body, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if "content_block_delta" in line:
                    break
        deadline = time.monotonic() + 10
        while not engine.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(engine.aborted) == 1 and engine.aborted[0].startswith("msg_")


def test_an_engine_failure_is_an_anthropic_error() -> None:
    """A step that raises: the stream ends with an `error` event and a whole request gets a 529 overloaded_error
    (the engine is gone: Anthropic's retryable status), both in Anthropic's shape."""
    with serve_in_thread(FakeEngine()) as running:
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": FAIL_STEP_MARKER}]}
        events = parse_events(
            httpx.post(f"{running.base_url}/v1/messages", json={**body, "stream": True}, timeout=30).text
        )
        assert events[0][0] == "message_start" and events[-1][0] == "error"
        assert events[-1][1]["error"]["type"] == "overloaded_error"
        response = httpx.post(f"{running.base_url}/v1/messages", json=body, timeout=30)
        assert_anthropic_error(response, 529, "overloaded_error")


def test_the_anthropic_client_lists_the_models(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    """`client.models.list()` gets Anthropic's page (type, id, display_name, created_at; has_more, first and last
    ids) while the OpenAI client still gets OpenAI's list, both naming the served model."""
    page = client.models.list()
    assert [(m.type, m.id, m.display_name) for m in page.data] == [("model", MODEL, MODEL)]
    assert page.data[0].created_at.year >= 2026
    assert (page.has_more, page.first_id, page.last_id) == (False, MODEL, MODEL)
    assert [m.id for m in chat.models.list().data] == [MODEL]
