"""Reasoning parsers, `chat_template_kwargs` and `--chat-template` through the HTTP API over the fake engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from api_fake_engine import LETTERS, FakeEngine, _Req, _Seq, serve_in_thread
from pagoda.server.api import AppSettings
from pagoda.server.chat import load_chat_template
from pagoda.server.config import ReasoningParserName

MODEL = "test-model"
SCRIPT = "<think>let me see</think>the answer"


class ScriptedEngine(FakeEngine):
    """The fake engine, but every sample writes `script` one character per step (a token each)."""

    def __init__(self, script: str, **kwargs: Any) -> None:
        # A step takes a real engine's few milliseconds: a stream that keeps up then gets a delta per token
        # (snapshots a reader has not taken yet are merged, so an instant engine would send one big delta).
        super().__init__(**{"step_seconds": 0.005, **kwargs})
        self.script = script

    def _advance(self, req: _Req, seq: _Seq) -> None:
        position = len(seq.token_ids)
        seq.token_ids.append(self._letter_ids[position % len(LETTERS)])  # the ids do not matter here
        seq.text += self.script[position]
        self.generation_tokens += 1
        if len(seq.token_ids) >= min(req.params.max_tokens, len(self.script)):
            seq.finish_reason = "length"


def _chat(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize(
    ("parser", "script", "reasoning", "content"),
    [
        ("qwen3", SCRIPT, "let me see", "the answer"),
        ("deepseek_r1", "let me see</think>the answer", "let me see", "the answer"),
    ],
)
def test_reasoning_parser_splits_whole_and_streamed_chats(
    parser: ReasoningParserName, script: str, reasoning: str, content: str
) -> None:
    """`--reasoning-parser` puts the think block in reasoning_content, the rest in content, streamed or not."""
    settings = AppSettings(reasoning_parser=parser)
    with serve_in_thread(ScriptedEngine(script), settings=settings) as running:
        client = _chat(running.base_url)
        messages: Any = [{"role": "user", "content": "q"}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64)
        message: Any = whole.choices[0].message
        assert (message.reasoning_content, message.content) == (reasoning, content)
        chunks = list(
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, stream=True)
        )
        deltas: list[Any] = [c.choices[0].delta for c in chunks if c.choices]
        streamed_reasoning = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
        streamed_content = [d.content for d in deltas if d.content]
        assert "".join(streamed_reasoning) == reasoning
        assert "".join(streamed_content) == content
        # Reasoning deltas come first, content after: no delta carries a tag or mixes the two phases back.
        first_content = next(i for i, d in enumerate(deltas) if d.content)
        assert all(not getattr(d, "reasoning_content", None) for d in deltas[first_content:])
        assert len(streamed_reasoning) > 1 and len(streamed_content) > 1


def test_without_a_parser_the_tags_stay_in_content() -> None:
    """No `--reasoning-parser`: the text is the content, tags and all, and reasoning_content is null."""
    with serve_in_thread(ScriptedEngine(SCRIPT)) as running:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "q"}], "max_tokens": 64}
        message = httpx.post(f"{running.base_url}/v1/chat/completions", json=body).json()["choices"][0][
            "message"
        ]
        assert message["content"] == SCRIPT and message["reasoning_content"] is None


def test_unfinished_think_block_is_all_reasoning() -> None:
    """Cut by max_tokens inside the block: reasoning only, content null."""
    with serve_in_thread(ScriptedEngine(SCRIPT), settings=AppSettings(reasoning_parser="qwen3")) as running:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "q"}], "max_tokens": 10}
        message = httpx.post(f"{running.base_url}/v1/chat/completions", json=body).json()["choices"][0][
            "message"
        ]
        assert message["reasoning_content"] == "let" and message["content"] is None


KWARGS_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}NOTHINK{% else %}THINK{% endif %}"
)


def _prompt_tokens(base_url: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body)


def test_chat_template_kwargs_reach_the_template() -> None:
    """`chat_template_kwargs` become template variables: the rendered prompt changes length with them."""
    with serve_in_thread(FakeEngine(chat_template=KWARGS_TEMPLATE)) as running:
        default = _prompt_tokens(running.base_url)
        off = _prompt_tokens(running.base_url, chat_template_kwargs={"enable_thinking": False})
        on = _prompt_tokens(running.base_url, chat_template_kwargs={"enable_thinking": True})
        assert default.json()["usage"]["prompt_tokens"] == len("hiTHINK")
        assert off.json()["usage"]["prompt_tokens"] == len("hiNOTHINK")
        assert on.json()["usage"]["prompt_tokens"] == len("hiTHINK")


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"tokenize": True}, "chat_template_kwargs"),  # a parameter of the renderer, not a variable
        ("enable_thinking", "chat_template_kwargs"),  # not an object
    ],
)
def test_bad_chat_template_kwargs_are_400(value: Any, field: str) -> None:
    """A key that would change the renderer's call, or a non-object, is a 400 naming the field."""
    with serve_in_thread(FakeEngine(chat_template=KWARGS_TEMPLATE)) as running:
        response = _prompt_tokens(running.base_url, chat_template_kwargs=value)
        assert response.status_code == 400 and response.json()["error"]["param"] == field
        assert _prompt_tokens(running.base_url).status_code == 200


def test_request_chat_template_stays_rejected() -> None:
    """The request's own `chat_template` is a 400 (vLLM takes it only behind a trust flag)."""
    with serve_in_thread(FakeEngine(chat_template=KWARGS_TEMPLATE)) as running:
        response = _prompt_tokens(running.base_url, chat_template="{{ 'x' }}")
        assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template"


def test_server_chat_template_overrides_the_tokenizers(tmp_path: Path) -> None:
    """`--chat-template` (AppSettings.chat_template) wins over the tokenizer's template, from a file or as text."""
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}", encoding="utf-8")
    for value in (str(path), "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"):
        template = load_chat_template(value)
        with serve_in_thread(
            FakeEngine(chat_template=KWARGS_TEMPLATE), settings=AppSettings(chat_template=template)
        ) as running:
            tokens = httpx.post(
                f"{running.base_url}/tokenize",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            ).json()["tokens"]
            prompt = _prompt_tokens(running.base_url).json()["usage"]["prompt_tokens"]
        expected = "[hi]" if value == str(path) else "<<hi>>"
        assert prompt == len(expected) == len(tokens)


def test_load_chat_template_refuses_a_mistyped_path(tmp_path: Path) -> None:
    """A value that is neither a file nor template-looking text is a ValueError naming the flag."""
    with pytest.raises(ValueError, match="--chat-template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
