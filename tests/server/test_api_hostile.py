"""Hostile inputs against the API over the fake engine (in-process uvicorn): deep JSON, lone surrogates, requests
that can never be admitted, fan-out past the caps, and a prompt long enough to stall a tokenizer."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from api_cases import MODEL, NESTED_BODIES, SURROGATE, SURROGATE_BODIES, surrogate_body
from api_fake_engine import FakeEngine, RunningServer, serve_in_thread
from pagoda.server.api import AppSettings
from pagoda.server.api.errors import APIError
from pagoda.server.config import RequestLimits

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """One server over a fast fake engine, with small fan-out caps, for the module."""
    limits = RequestLimits(max_prompts_per_request=4, max_sequences_per_request=8)
    with serve_in_thread(FakeEngine(max_model_len=64), settings=AppSettings(limits=limits)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    """The official OpenAI client pointed at the server."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def assert_good_request(client: openai.OpenAI) -> None:
    """The server still serves after a hostile request."""
    result = client.completions.create(model=MODEL, prompt="ok", max_tokens=2)
    assert result.choices[0].finish_reason == "length"


def assert_400(response: httpx.Response, param: str | None) -> dict[str, Any]:
    """An OpenAI-shaped 400 naming `param`; returns its error object."""
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    return error


@pytest.mark.parametrize(("path", "content"), NESTED_BODIES, ids=range(len(NESTED_BODIES)))
def test_deeply_nested_json_is_400(
    server: RunningServer, client: openai.OpenAI, path: str, content: bytes
) -> None:
    """JSON nested 100,000 deep, as the body or inside a field, is a 400, not a RecursionError's 500."""
    error = assert_400(httpx.post(server.base_url + path, content=content, headers=JSON), None)
    assert "nested too deeply" in error["message"]
    assert_good_request(client)


def test_json_deep_but_parseable_is_validated(server: RunningServer, client: openai.OpenAI) -> None:
    """Nesting the parser takes is checked by the models: a 400 in `prompt`, and a 400 naming an unknown field
    (unknown fields are rejected, as OpenAI does)."""
    deep = "[" * 500 + "1" + "]" * 500
    url = f"{server.base_url}/v1/completions"
    assert_400(httpx.post(url, content=f'{{"prompt": {deep}}}', headers=JSON), "prompt")
    assert_400(
        httpx.post(url, content=f'{{"prompt": "hi", "max_tokens": 1, "x": {deep}}}', headers=JSON), "x"
    )
    assert_good_request(client)


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_BODIES)
def test_lone_surrogate_is_400_naming_the_field(
    server: RunningServer, client: openai.OpenAI, path: str, body: dict[str, Any], param: str | None
) -> None:
    """A lone surrogate in any string field is a 400 naming the field, never the tokenizer's 500."""
    response = httpx.post(server.base_url + path, content=surrogate_body(body), headers=JSON)
    assert "surrogate" in assert_400(response, param)["message"]
    assert_good_request(client)


def test_surrogate_pairs_are_text(server: RunningServer) -> None:
    """An escaped surrogate pair is one character, not a lone half: it is tokenized like any other text."""
    body = json.dumps({"prompt": "a\U0001f600", "add_special_tokens": False}).encode()
    assert b"\\ud83d\\ude00" in body
    response = httpx.post(f"{server.base_url}/tokenize", content=body, headers=JSON)
    assert response.status_code == 200 and response.json()["count"] == 2  # 'a' and <unk>


def test_error_message_quoting_a_surrogate_still_encodes() -> None:
    """An error whose message quotes client text with a lone surrogate renders as JSON (escaped)."""
    response = APIError(404, f"The model `{SURROGATE}` does not exist.", param="model").to_response()
    assert json.loads(bytes(response.body))["error"]["message"] == "The model `\\ud800` does not exist."


def test_request_over_the_waiting_limit_alone_is_400_not_429() -> None:
    """--max-waiting-requests 4: 8 prompts or n = 8 can never be admitted (400 naming the field, every time,
    even on an idle server); 4 prompts, or 2 prompts x n = 2, are admitted."""
    with serve_in_thread(FakeEngine(), max_waiting_requests=4) as running:
        url = f"{running.base_url}/v1/completions"
        for _ in range(2):  # not a 429 to retry: the same answer again
            many = httpx.post(
                url, json={"model": MODEL, "prompt": [f"p{i}" for i in range(8)], "max_tokens": 1}
            )
            assert "never" in assert_400(many, "prompt")["message"]
        assert_400(httpx.post(url, json={"model": MODEL, "prompt": "p", "max_tokens": 1, "n": 8}), "n")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": 5}
        assert_400(httpx.post(f"{running.base_url}/v1/chat/completions", json=chat), "n")
        four = httpx.post(url, json={"model": MODEL, "prompt": ["a", "b", "c", "d"], "max_tokens": 1})
        assert four.status_code == 200 and len(four.json()["choices"]) == 4
        two_by_two = httpx.post(url, json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1, "n": 2})
        assert two_by_two.status_code == 200 and len(two_by_two.json()["choices"]) == 4
        assert running.llm.num_pending_sequences == 0


def test_fan_out_at_and_over_the_caps(server: RunningServer, client: openai.OpenAI) -> None:
    """Caps of 4 prompts and 8 sequences: a request at both caps is served; one past either is a 400."""
    url = f"{server.base_url}/v1/completions"
    at_caps = httpx.post(url, json={"model": MODEL, "prompt": ["a", "b", "c", "d"], "max_tokens": 1, "n": 2})
    assert at_caps.status_code == 200 and len(at_caps.json()["choices"]) == 8
    five = httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 5, "max_tokens": 1})
    assert "--max-prompts-per-request" in assert_400(five, "prompt")["message"]
    wide = httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 3, "max_tokens": 1, "n": 3})
    assert "--max-sequences-per-request" in assert_400(wide, "n")["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": 9}
    assert_400(httpx.post(f"{server.base_url}/v1/chat/completions", json=chat), "n")
    assert_good_request(client)


def test_default_caps_refuse_a_huge_fan_out() -> None:
    """With the default caps 10,000 prompts x n = 16 is a 400; 2048 prompts (the cap) are served."""
    with serve_in_thread(FakeEngine()) as running:
        url = f"{running.base_url}/v1/completions"
        huge = httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 10_000, "n": 16}, timeout=60)
        assert_400(huge, "prompt")
        wide = httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 129, "n": 16}, timeout=60)
        assert_400(wide, "n")
        full = httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 2048, "max_tokens": 1}, timeout=120)
        assert full.status_code == 200 and len(full.json()["choices"]) == 2048


def test_health_answers_while_a_4mb_prompt_is_tokenized() -> None:
    """Tokenizing a 4 MB prompt (seconds with this tokenizer, which has no cheap length bound) runs off the
    event loop: /health keeps answering meanwhile, and the prompt then gets its 400."""
    with serve_in_thread(FakeEngine(max_model_len=64)) as running:

        async def scenario() -> tuple[httpx.Response, list[float], int]:
            async with httpx.AsyncClient(timeout=120) as http:
                body = {"model": MODEL, "prompt": "abcd " * 800_000}
                rejected = asyncio.ensure_future(http.post(f"{running.base_url}/v1/completions", json=body))
                latencies: list[float] = []
                while not rejected.done():
                    start = time.monotonic()
                    health = await http.get(f"{running.base_url}/health")
                    latencies.append(time.monotonic() - start)
                    assert health.status_code == 200
                    await asyncio.sleep(0.05)
                return await rejected, latencies, running.engine.num_steps

        start = time.monotonic()
        rejected, latencies, steps = asyncio.run(scenario())
        took = time.monotonic() - start
        assert_400(rejected, "prompt")
        # On the loop, the tokenization (most of `took`: ~7 s here, the rest is 4 MB of JSON) would hold one /health
        # answer for nearly all of it; off it, the worst answer waits for what still holds the GIL (0.13 s alone,
        # 1.5 s seen under a full test run's load, when `took` grows too). A share of `took`, not seconds.
        assert max(latencies) < took / 4, (max(latencies), took)
        assert len(latencies) > 3, "the prompt was rejected before /health was asked; the test proves nothing"
        assert steps == 0
        good = httpx.post(f"{running.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert good.status_code == 200
