"""POST /v1/responses (issue 26) over the fake engine with the official openai client: input items, reasoning and
function-call items, the streamed event sequence and its reassembly, the per-key store, background + cancel,
and a 400 naming the field for every bad input."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import openai
import pytest
from api_fake_engine import LETTERS, FakeEngine, _Req, _Seq, serve_in_thread
from pagoda.server.api import AppSettings
from pagoda.server.multimodal import MultiModalInputs
from pagoda.server.sampling_params import SamplingParams

MODEL = "test-model"
THINK = "<think>let me see</think>the answer"
HERMES = '<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}</tool_call>'
TOOLS: Any = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


class ScriptEngine(FakeEngine):
    """The fake engine writing `script` one character per step, finishing `stop` where the script ends; it keeps
    every prompt it was sent."""

    def __init__(self, script: str, **kwargs: Any) -> None:
        super().__init__(**{"step_seconds": 0.002, "max_model_len": 4096, **kwargs})
        self.script = script
        self.prompts: list[str] = []

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> None:
        """Record the prompt, then queue as the fake does."""
        self.prompts.append(prompt or "")
        super().add_request(request_id, prompt_token_ids, params, prompt=prompt, arrival_time=arrival_time)

    def _advance(self, req: _Req, seq: _Seq) -> None:
        position = len(seq.token_ids)
        seq.token_ids.append(self._letter_ids[position % len(LETTERS)])
        seq.text += self.script[position]
        self.generation_tokens += 1
        if len(seq.token_ids) >= len(self.script):
            seq.finish_reason = "stop"
        elif len(seq.token_ids) >= req.params.max_tokens:
            seq.finish_reason = "length"


def _client(base_url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60)


def _texts(output: Any) -> list[tuple[str, str]]:
    """(type, text) of each output item: the message's text, the reasoning's text, the call's name:arguments."""
    items: list[tuple[str, str]] = []
    for item in output:
        data = item if isinstance(item, dict) else item.model_dump()
        if data["type"] == "message":
            items.append(("message", "".join(p["text"] for p in data["content"])))
        elif data["type"] == "reasoning":
            items.append(("reasoning", "".join(p["text"] for p in data["content"] or ())))
        else:
            items.append(("function_call", f"{data['name']}:{data['arguments']}"))
    return items


def test_create_with_a_string_and_with_input_items() -> None:
    """A string input and message items (input_text parts, instructions): the text, usage and status."""
    engine = ScriptEngine("hello there")
    with serve_in_thread(engine) as running:
        client = _client(running.base_url)
        response = client.responses.create(
            model=MODEL, input="say hi", temperature=0.0, extra_body={"seed": 3}
        )
        assert response.status == "completed" and response.object == "response"
        assert response.output_text == "hello there"
        assert response.usage is not None
        assert response.usage.output_tokens == len("hello there")
        assert response.usage.input_tokens > 0
        assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
        assert response.usage.input_tokens_details.cached_tokens == 0
        assert "say hi" in engine.prompts[-1]
        items: Any = [
            {"role": "user", "content": [{"type": "input_text", "text": "first part"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "second"}]},
        ]
        cut = client.responses.create(model=MODEL, input=items, instructions="be brief", max_output_tokens=4)
        assert cut.status == "incomplete" and cut.output_text == "hell"
        assert cut.incomplete_details is not None and cut.incomplete_details.reason == "max_output_tokens"
        prompt = engine.prompts[-1]
        assert prompt.index("be brief") < prompt.index("first part") < prompt.index("second")
        assert cut.instructions == "be brief" and cut.max_output_tokens == 4


def test_reasoning_items_with_a_reasoning_parser() -> None:
    """--reasoning-parser: a reasoning item, then the message; without it the tags stay in the text."""
    with serve_in_thread(ScriptEngine(THINK), settings=AppSettings(reasoning_parser="qwen3")) as running:
        response = _client(running.base_url).responses.create(model=MODEL, input="q")
        assert _texts(response.output) == [("reasoning", "let me see"), ("message", "the answer")]
        assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens > 0
    with serve_in_thread(ScriptEngine(THINK)) as running:
        response = _client(running.base_url).responses.create(model=MODEL, input="q")
        assert _texts(response.output) == [("message", THINK)]


TOOL_SETTINGS = AppSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


def test_function_calls_and_their_outputs_continue_the_conversation() -> None:
    """Function tools under auto give function_call items; a function_call_output on previous_response_id
    reaches the prompt after the stored call."""
    engine = ScriptEngine(HERMES)
    with serve_in_thread(engine, settings=TOOL_SETTINGS) as running:
        client = _client(running.base_url)
        response = client.responses.create(model=MODEL, input="weather in paris?", tools=TOOLS)
        (call,) = response.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "paris"}
        assert response.tool_choice == "auto"
        follow: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny and warm"}]
        client.responses.create(model=MODEL, input=follow, tools=TOOLS, previous_response_id=response.id)
        prompt = engine.prompts[-1]
        assert prompt.index("weather in paris?") < prompt.index("sunny and warm")
        # The whole history as items (the earlier call sent back) renders the same prompt.
        echoed: Any = [
            {"role": "user", "content": "weather in paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            follow[0],
        ]
        client.responses.create(model=MODEL, input=echoed, tools=TOOLS, store=False)
        assert engine.prompts[-1] == prompt


def _events(base_url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{base_url}/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_stream_event_sequence_and_reassembly() -> None:
    """The official event order with increasing sequence numbers; the deltas and the completed response equal
    the non-streamed response (reasoning, then text)."""
    with serve_in_thread(ScriptEngine(THINK), settings=AppSettings(reasoning_parser="qwen3")) as running:
        whole = httpx.post(f"{running.base_url}/v1/responses", json={"input": "q"}).json()
        events = _events(running.base_url, {"input": "q"})
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        kinds = [e["type"] for e in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert kinds[-1] == "response.completed"
        collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
        assert collapsed == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        completed = events[-1]["response"]
        assert [("reasoning", reasoning), ("message", text)] == _texts(completed["output"])
        assert _texts(completed["output"]) == _texts(whole["output"])
        assert completed["usage"] == whole["usage"]
        done_items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert done_items == completed["output"]


def test_stream_function_call_events_and_the_client_helper() -> None:
    """Calls stream as function_call_arguments deltas; client.responses.stream reassembles the final response."""
    with serve_in_thread(ScriptEngine(HERMES), settings=TOOL_SETTINGS) as running:
        client = _client(running.base_url)
        whole = client.responses.create(model=MODEL, input="q", tools=TOOLS)
        with client.responses.stream(model=MODEL, input="q", tools=TOOLS) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
        assert _texts(final.output) == _texts(whole.output)
        assert final.output[0].type == "function_call"
        assert json.loads(final.output[0].arguments) == {"city": "paris"}


def test_store_retrieve_delete_and_store_false() -> None:
    """Stored by default: GET returns it, DELETE forgets it (404 after); store false is never kept."""
    with serve_in_thread(ScriptEngine("abc")) as running:
        client = _client(running.base_url)
        response = client.responses.create(model=MODEL, input="q")
        assert client.responses.retrieve(response.id).output_text == "abc"
        client.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(response.id)
        assert info.value.body["param"] == "response_id"  # type: ignore[index]
        unstored = client.responses.create(model=MODEL, input="q", store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unstored.id)
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.create(model=MODEL, input="q", previous_response_id=unstored.id)
        assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_store_is_isolated_per_api_key_and_bounded() -> None:
    """A key cannot read, continue, cancel or delete another key's response; beyond --max-stored-responses the
    key's own least recently used response goes first, another key's never."""
    settings = AppSettings(api_key=("key-a", "key-b"), max_stored_responses=2)
    with serve_in_thread(ScriptEngine("abc"), settings=settings) as running:
        a, b = _client(running.base_url, "key-a"), _client(running.base_url, "key-b")
        mine = a.responses.create(model=MODEL, input="q")
        for call in (
            lambda: b.responses.retrieve(mine.id),
            lambda: b.responses.delete(mine.id),
            lambda: b.responses.cancel(mine.id),
            lambda: b.responses.create(model=MODEL, input="q", previous_response_id=mine.id),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert a.responses.retrieve(mine.id).id == mine.id
        second = a.responses.create(model=MODEL, input="q")
        a.responses.retrieve(mine.id)  # now the most recently used
        third = b.responses.create(model=MODEL, input="q")  # b's own quota: a's responses stay
        assert a.responses.retrieve(second.id).id == second.id
        fourth = a.responses.create(model=MODEL, input="q")  # a's third: a's least recently used goes
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(mine.id)
        assert a.responses.retrieve(fourth.id).id == fourth.id
        assert b.responses.retrieve(third.id).id == third.id


def test_storing_off_refuses_background_and_keeps_nothing() -> None:
    """--max-stored-responses 0: a background response is a 400 naming background (it could not be read back);
    a stored-by-default one is answered and kept nowhere; streamed ones release their place."""
    with serve_in_thread(ScriptEngine("abc"), settings=AppSettings(max_stored_responses=0)) as running:
        client = _client(running.base_url)
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, input="q", background=True)
        assert info.value.body["param"] == "background"  # type: ignore[index]
        done = client.responses.create(model=MODEL, input="q")
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(done.id)
    with serve_in_thread(ScriptEngine("abc"), settings=AppSettings(max_stored_responses=1)) as running:
        client = _client(running.base_url)
        for _ in range(3):  # each streamed response's place is its own until it is stored, then the LRU's
            with client.responses.stream(model=MODEL, input="q") as stream:
                final = stream.get_final_response()
        assert client.responses.retrieve(final.id).output_text == "abc"
    engine = ScriptEngine("x" * 4000, step_seconds=0.01)
    with serve_in_thread(engine, settings=AppSettings(max_stored_responses=1)) as running:
        body = {"model": MODEL, "input": "q", "stream": True}
        with httpx.stream("POST", f"{running.base_url}/v1/responses", json=body, timeout=60) as response:
            next(response.iter_lines())  # the client leaves mid-stream: its held place is given back
        deadline = time.monotonic() + 30
        while True:
            again = httpx.post(
                f"{running.base_url}/v1/responses", json={**body, "stream": False, "background": True}
            )
            if again.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert again.status_code == 200, again.text
        httpx.post(f"{running.base_url}/v1/responses/{again.json()['id']}/cancel")


def test_background_response_is_cancelled() -> None:
    """background: answered queued at once; cancel stops the engine request and the response ends cancelled;
    a finished response cannot be cancelled (a 400 naming response_id)."""
    engine = ScriptEngine("x" * 4000, step_seconds=0.01)
    with serve_in_thread(engine) as running:
        client = _client(running.base_url)
        started = client.responses.create(model=MODEL, input="q", background=True)
        assert started.status in ("queued", "in_progress")
        deadline = time.monotonic() + 30
        while client.responses.retrieve(started.id).status != "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cancelled = client.responses.cancel(started.id)
        assert cancelled.status == "cancelled"
        assert client.responses.retrieve(started.id).status == "cancelled"
        deadline = time.monotonic() + 30
        while started.id not in engine.aborted:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    with serve_in_thread(ScriptEngine("ab")) as running:
        client = _client(running.base_url)
        done = client.responses.create(model=MODEL, input="q")
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.cancel(done.id)
        assert info.value.body["param"] == "response_id"  # type: ignore[index]


BAD_BODIES: list[tuple[dict[str, Any], str]] = [
    ({"input": "q", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "q", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    ({"input": "q", "tools": [{"type": "function", "name": "bad name!"}]}, "tools"),
    ({"input": "q", "tools": [{"type": "function", "name": "f", "parameters": {"type": 7}}]}, "tools"),
    ({"input": "q", "frobnicate": 1}, "frobnicate"),
    ({"input": 7}, "input"),
    ({"input": [{"type": "image", "url": "x"}]}, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
    ({"input": "q", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "q", "temperature": -1.0}, "temperature"),
    ({"input": "q", "top_p": 2.0}, "top_p"),
    ({"input": "q", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": "q", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "q", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "q", "truncation": "auto"}, "truncation"),
    ({"input": "q", "tool_choice": "required"}, "tool_choice"),
    ({"input": "q", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "q", "tools": TOOLS}, "tool_choice"),  # auto needs --enable-auto-tool-choice
    ({"input": "q", "background": True, "store": False}, "background"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": ""}, "input"),
    ({"input": "q", "model": "other"}, "model"),
]


@pytest.fixture(scope="module")
def plain() -> Iterator[str]:
    """One fake server for the bad-input cases: its base URL."""
    with serve_in_thread(ScriptEngine("ok")) as running:
        yield running.base_url


@pytest.mark.parametrize(("body", "param"), BAD_BODIES)
def test_bad_input_is_a_400_naming_the_field(plain: str, body: dict[str, Any], param: str) -> None:
    """Every bad input is an OpenAI-shaped error naming its field, and the server goes on serving."""
    response = httpx.post(f"{plain}/v1/responses", json=body)
    error = response.json()["error"]
    assert error["param"] == param, error
    assert response.status_code == (404 if param == "model" else 400), response.text
    again = httpx.post(f"{plain}/v1/responses", json={"input": "q"})
    assert again.status_code == 200 and again.json()["status"] == "completed"
