"""The fields of issue 26 over the fake engine: `return_tokens_as_token_ids`, `stream_options.
continuous_usage_stats`, the legacy `functions` / `function_call` mapped onto tools; and offline
`LLM.chat(tools=..., chat_template_kwargs=...)` on a tiny model."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_fake_engine import FakeEngine, serve_in_thread
from pagoda.server.api import AppSettings
from pagoda.server.llm import LLM
from pagoda.server.sampling_params import SamplingParams
from test_responses_api import HERMES, ScriptEngine

MODEL = "test-model"
TOKEN_ID = re.compile(r"^token_id:\d+$")
MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def fake() -> Iterator[str]:
    """A fake server's base URL."""
    # A step takes a few milliseconds, so that a stream that keeps up gets a chunk per token.
    with serve_in_thread(FakeEngine(step_seconds=0.005)) as running:
        yield running.base_url


def _events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_completion_tokens_as_token_ids(fake: str) -> None:
    """Every token and every top_logprobs key is `token_id:<id>`, whole and streamed; off, they are text."""
    body = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 5,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
    }
    logprobs = httpx.post(f"{fake}/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 5 and all(TOKEN_ID.match(t) for t in logprobs["tokens"])
    assert all(TOKEN_ID.match(k) for top in logprobs["top_logprobs"] for k in top)
    streamed = [c["choices"][0]["logprobs"]["tokens"] for c in _events(f"{fake}/v1/completions", body)]
    assert [t for tokens in streamed for t in tokens] == logprobs["tokens"]
    plain = httpx.post(f"{fake}/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
    assert not any(TOKEN_ID.match(t) for t in plain["choices"][0]["logprobs"]["tokens"])


def test_chat_tokens_as_token_ids(fake: str) -> None:
    """Chat logprobs name the sampled token and its alternatives by id, whole and streamed."""
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 2,
        "return_tokens_as_token_ids": True,
    }
    content = httpx.post(f"{fake}/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert TOKEN_ID.match(entry["token"]) and all(
            TOKEN_ID.match(t["token"]) for t in entry["top_logprobs"]
        )
    streamed = [
        e["token"]
        for c in _events(f"{fake}/v1/chat/completions", body)
        if c["choices"] and c["choices"][0].get("logprobs")
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == [e["token"] for e in content]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_continuous_usage_stats(fake: str, endpoint: str) -> None:
    """With include_usage and continuous_usage_stats, every chunk with a choice carries the usage so far
    (completion tokens never shrink, ending at the final count); without it, only the last chunk does."""
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 6}
    base.update({"prompt": "hello"} if endpoint == "completions" else {"messages": MESSAGES})
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _events(f"{fake}/v1/{endpoint}", {**base, "stream_options": options})
    with_choices = [c for c in chunks if c["choices"] and c["usage"] is not None]
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert len(counts) >= 2 and counts == sorted(counts) and counts[-1] == 6
    assert all(c["usage"]["prompt_tokens"] > 0 for c in with_choices)
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    plain = _events(f"{fake}/v1/{endpoint}", {**base, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain if c["choices"])


def test_legacy_functions_map_onto_tools() -> None:
    """functions + function_call {"name"} force that function (a tool call); with the auto parser, functions
    alone are auto; the response's calls are tool_calls."""
    with serve_in_thread(ScriptEngine('{"city": "x"}')) as running:
        url = f"{running.base_url}/v1/chat/completions"
        body = {"messages": MESSAGES, "functions": [WEATHER], "function_call": {"name": "get_weather"}}
        message = httpx.post(url, json=body).json()["choices"][0]["message"]
        (call,) = message["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "x"}'}
        none = httpx.post(url, json={**body, "function_call": "none"}).json()["choices"][0]["message"]
        assert none["tool_calls"] == [] and none["content"] == '{"city": "x"}'
    settings = AppSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serve_in_thread(ScriptEngine(HERMES), settings=settings) as running:
        url = f"{running.base_url}/v1/chat/completions"
        choice = httpx.post(url, json={"messages": MESSAGES, "functions": [WEATHER]}).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


BAD_LEGACY: list[tuple[dict[str, Any], str]] = [
    ({"functions": {"name": "f"}}, "functions"),
    ({"functions": [{"name": "bad name"}]}, "functions"),
    ({"functions": [WEATHER], "function_call": {"nom": "x"}}, "function_call"),
    ({"functions": [WEATHER], "function_call": {"name": "other"}}, "function_call"),
    ({"functions": [WEATHER], "tools": [{"type": "function", "function": WEATHER}]}, "functions"),
    ({"functions": [WEATHER]}, "functions"),  # auto needs --enable-auto-tool-choice
    ({"function_call": "auto"}, "function_call"),  # no functions to call
]


@pytest.mark.parametrize(("extra", "param"), BAD_LEGACY)
def test_bad_legacy_fields_name_themselves(fake: str, extra: dict[str, Any], param: str) -> None:
    """A 400 naming functions or function_call, and the server goes on serving."""
    response = httpx.post(f"{fake}/v1/chat/completions", json={"messages": MESSAGES, **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert httpx.post(f"{fake}/v1/chat/completions", json={"messages": MESSAGES}).status_code == 200


TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if tools %} tools {{ tools[0]['function']['name'] }}{% endif %}"
    "{% if mood is defined %} mood {{ mood }}{% endif %}"
)


def test_offline_chat_with_tools_and_template_kwargs(tiny_model_path: Callable[[str], Path]) -> None:
    """LLM.chat renders `tools` and `chat_template_kwargs` into the prompt; a renderer parameter is refused."""
    llm = LLM(str(tiny_model_path("llama")), max_model_len=256)
    llm.tokenizer.chat_template = TEMPLATE
    tools = [{"type": "function", "function": WEATHER}]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    (plain,) = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)
    (out,) = llm.chat(
        [{"role": "user", "content": "hi"}],
        params,
        use_tqdm=False,
        tools=tools,
        chat_template_kwargs={"mood": "calm"},
    )
    assert str(llm.tokenizer.decode(list(plain.prompt_token_ids))).strip() == "hi"
    assert str(llm.tokenizer.decode(list(out.prompt_token_ids))).strip() == "hi tools get_weather mood calm"
    with pytest.raises(ValueError, match="tokenize"):
        llm.chat([{"role": "user", "content": "hi"}], params, chat_template_kwargs={"tokenize": True})
