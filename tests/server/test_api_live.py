"""The real server (`python -m pagoda.server.cli serve`) over a tiny random-weight model, in a subprocess,
driven by the official OpenAI clients, httpx and schemathesis."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import schemathesis
from api_cases import (
    BAD_CHATS,
    BAD_COMPLETIONS,
    MALFORMED_BODIES,
    MAX_MODEL_LEN,
    MODEL,
    NESTED_BODIES,
    NON_FINITE_BODIES,
    SURROGATE_BODIES,
    surrogate_body,
)
from hypothesis import HealthCheck, example, given, settings
from pagoda.server import testing
from pagoda.server.testing import make_tiny_model
from raw_http import assert_openai_error, connect, post_head, read_response
from schemathesis import GenerationMode

ROOT = Path(__file__).resolve().parents[2]
NO_EOS: dict[str, Any] = {"ignore_eos": True}  # fixed output lengths: a random model may emit EOS anywhere


# The live tests' server: a tiny KV cache and float32 (greedy outputs alone and in a batch must agree, and
# bfloat16 matmuls vary with the batch size).
TEST_FLAGS = ("--kv-cache-gib", "0.05", "--dtype", "float32")


class LiveServer(testing.LiveServer):
    """A `pagoda serve` subprocess of `model` with the tests' settings on a free port of 127.0.0.1, healthy."""

    def __init__(self, model: Path, *extra: str, ready_timeout: float = 120) -> None:
        super().__init__(
            model, [*TEST_FLAGS, *extra], served_model_name=MODEL, ready_timeout=ready_timeout, cwd=ROOT
        )


@contextlib.contextmanager
def serving(model: Path, *extra: str, ready_timeout: float = 120) -> Iterator[LiveServer]:
    """A live server for the block; it must exit cleanly on SIGTERM."""
    server = LiveServer(model, *extra, ready_timeout=ready_timeout)
    try:
        yield server
    finally:
        assert server.stop() == 0


def sync_client(live: LiveServer) -> openai.OpenAI:
    """The official synchronous OpenAI client of a live server (no retries)."""
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a 4096-token context, saved like a hub checkout."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[LiveServer]:
    """One server for the module."""
    with serving(model_dir, "--max-model-len", str(MAX_MODEL_LEN)) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    """The official synchronous OpenAI client."""
    return sync_client(live)


def metric(text: str, name: str) -> float:
    """The value of the sample `name{...}` in a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def assert_good_request(client: openai.OpenAI) -> None:
    """The server still serves after a bad request."""
    result = client.completions.create(model=MODEL, prompt="ok", max_tokens=2, extra_body=NO_EOS)
    assert result.choices[0].finish_reason == "length"


def greedy(client: openai.OpenAI, prompt: str, max_tokens: int) -> str:
    """The greedy completion of `prompt` sent alone."""
    result = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=NO_EOS
    )
    return result.choices[0].text


def test_completion_stream_and_whole_agree_with_usage(client: openai.OpenAI) -> None:
    """Streamed deltas add up to the whole greedy text; usage counts prompt and completion tokens."""
    whole = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0, extra_body=NO_EOS
    )
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The quick brown fox",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None


def test_prefix_cache_hits_show_in_usage(client: openai.OpenAI) -> None:
    """The same long prompt twice: the second is served partly from the prefix cache."""
    prompt = list(range(10, 10 + 40))
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) >= 32  # two full blocks of 16


def test_chat_sync_and_async_clients(live: LiveServer, client: openai.OpenAI) -> None:
    """A chat through both clients: the same greedy message, streamed with the role first and usage last."""
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"

    async def stream() -> list[Any]:
        async_client = openai.AsyncOpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0)
        try:
            events = await async_client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=NO_EOS,
            )
            return [chunk async for chunk in events]
        finally:
            await async_client.close()

    chunks = asyncio.run(stream())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    assert whole.usage is not None and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_and_seed_determinism(client: openai.OpenAI) -> None:
    """n = 2 gives two choices; a seed makes sampling repeatable; another seed changes it."""

    def sample(seed: int) -> list[str]:
        result = client.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=24, n=2, temperature=1.0, seed=seed, extra_body=NO_EOS
        )
        assert sorted(c.index for c in result.choices) == [0, 1]
        return [c.text for c in sorted(result.choices, key=lambda c: c.index)]

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first
    chat = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=16,
            seed=3,
            n=2,
            extra_body=NO_EOS,
        )
        for _ in range(2)
    ]
    assert [c.message.content for c in chat[0].choices] == [c.message.content for c in chat[1].choices]


def test_seeded_request_same_alone_and_among_16_concurrent(client: openai.OpenAI) -> None:
    """A seeded completion gives the same text alone as among 15 concurrent seeded and unseeded ones."""

    def complete(prompt: str, seed: int | None, temperature: float = 1.0) -> str:
        result = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=16,
            temperature=temperature,
            top_p=0.95,
            seed=seed,
            extra_body=NO_EOS,
        )
        return result.choices[0].text

    alone = complete("Once upon a time", 4242)
    others = [(f"Prompt number {i} says", i if i % 2 else None, 0.5 + 0.1 * i) for i in range(15)]
    with ThreadPoolExecutor(16) as pool:
        target = pool.submit(complete, "Once upon a time", 4242)
        crowd = [pool.submit(complete, *args) for args in others]
        assert target.result() == alone
        assert all(future.result() is not None for future in crowd)


def test_beam_search_completion(client: openai.OpenAI) -> None:
    """use_beam_search returns the n best of best_of beams, best first, the same every time."""

    def search() -> list[str]:
        result = client.completions.create(
            model=MODEL,
            prompt="Once upon",
            max_tokens=8,
            n=2,
            best_of=4,
            extra_body={"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True},
        )
        assert sorted(c.index for c in result.choices) == [0, 1]
        return [c.text for c in sorted(result.choices, key=lambda c: c.index)]

    first = search()
    assert search() == first
    assert first[0] != first[1]  # distinct beams


@pytest.mark.parametrize("stop_len", [1, 3])
def test_stop_string_ends_the_text(client: openai.OpenAI, stop_len: int) -> None:
    """A stop string taken from the greedy text cuts it there with finish_reason stop, streamed or not (a
    stream never sends text that the stop string later takes back)."""
    full = greedy(client, "Hello world", 40)
    start = next(i for i in range(1, len(full)) if full[i : i + stop_len].isalnum())
    stop = full[start : start + stop_len]
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "Hello world", "max_tokens": 40, "temperature": 0}
    result = client.completions.create(**kwargs, stop=[stop], extra_body=NO_EOS)
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == full[: full.index(stop)]
    assert result.choices[0].model_extra is not None and result.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(**kwargs, stop=[stop], stream=True, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == result.choices[0].text


def test_logprobs_completion_and_chat(client: openai.OpenAI) -> None:
    """Completions list k alternatives per token; chat gives top_logprobs per content token."""
    result = client.completions.create(
        model=MODEL, prompt="Tokens", max_tokens=6, temperature=0, logprobs=3, extra_body=NO_EOS
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs) == 6 and all(
        lp is not None and lp <= 0 for lp in logprobs.token_logprobs
    )
    assert all(t is not None and len(t) >= 1 for t in logprobs.top_logprobs)
    assert logprobs.tokens is not None and len(logprobs.tokens) == 6
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=NO_EOS,
    )
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == 5
    assert all(len(token.top_logprobs) == 2 and token.logprob <= 0 for token in content)
    # Greedy: the sampled token is the most likely one.
    assert all(token.logprob >= token.top_logprobs[0].logprob - 1e-5 for token in content)


def test_32_concurrent_greedy_streams_match_each_alone(live: LiveServer, client: openai.OpenAI) -> None:
    """Continuous batching does not change greedy output: 32 concurrent streams equal 32 solo requests."""
    prompts = [f"Request number {i} says" for i in range(32)]
    alone = [greedy(client, p, 10) for p in prompts]

    async def together() -> list[str]:
        async_client = openai.AsyncOpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0)

        async def one(prompt: str) -> str:
            events = await async_client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True, extra_body=NO_EOS
            )
            return "".join([c.choices[0].text async for c in events if c.choices])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await async_client.close()

    assert asyncio.run(together()) == alone


async def cut_off_requests(
    live: LiveServer, count: int, max_tokens: int, deadline: Callable[[int], float]
) -> int:
    """Send `count` completions (every other one streamed), request i cut off by the client after `deadline(i)`
    seconds; returns how many were cut off."""
    timeouts = 0
    async with httpx.AsyncClient(timeout=30) as http:

        async def one(i: int) -> None:
            nonlocal timeouts
            body = {
                "model": MODEL,
                "prompt": [10, 11, 12 + i],
                "max_tokens": max_tokens,
                "stream": i % 2 == 0,
            }
            try:
                # A total deadline, so that streams that keep delivering tokens are cut off too.
                async with asyncio.timeout(deadline(i)):
                    url = f"{live.base_url}/v1/completions"
                    async with http.stream("POST", url, json={**body, **NO_EOS}) as response:
                        async for _ in response.aiter_lines():
                            pass
            except TimeoutError:
                timeouts += 1

        await asyncio.gather(*(one(i) for i in range(count)))
    return timeouts


def test_cancelled_requests_free_everything(live: LiveServer, client: openai.OpenAI) -> None:
    """100 requests that time out on the client are aborted in the engine (far fewer tokens are generated
    than asked for); afterwards nothing runs or waits and no KV block is in use."""
    max_tokens = MAX_MODEL_LEN - 8

    def generated() -> float:
        return metric(httpx.get(f"{live.base_url}/metrics").text, "pagoda:generation_tokens_total")

    before = generated()
    assert asyncio.run(cut_off_requests(live, 100, max_tokens, lambda i: 0.3)) > 0
    assert_good_request(client)
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{live.base_url}/metrics").text
        idle = [
            metric(text, "pagoda:num_requests_running"),
            metric(text, "pagoda:num_requests_waiting"),
            metric(text, "pagoda:kv_cache_usage_perc"),
        ]
        if idle == [0, 0, 0] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle == [0, 0, 0]
    # Without aborts every request would have run to max_tokens by now.
    assert generated() - before < 100 * max_tokens


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_is_400(
    live: LiveServer, client: openai.OpenAI, body: dict[str, Any], param: str | None
) -> None:
    """Each bad completion field is an OpenAI-shaped 400 naming it, and the server keeps serving."""
    response = httpx.post(f"{live.base_url}/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["param"] == param
    assert_good_request(client)


@pytest.mark.parametrize(("body", "param"), BAD_CHATS)
def test_bad_chat_is_400(
    live: LiveServer, client: openai.OpenAI, body: dict[str, Any], param: str | None
) -> None:
    """Each bad chat body is a 400 naming the field, and the server keeps serving."""
    response = httpx.post(f"{live.base_url}/v1/chat/completions", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert_good_request(client)


@pytest.mark.parametrize(("content", "content_type", "message"), MALFORMED_BODIES)
def test_malformed_body_is_400(
    live: LiveServer, client: openai.OpenAI, content: bytes, content_type: str, message: str
) -> None:
    """Malformed JSON, non-object bodies and wrong content types are 400s, never 500s."""
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        response = httpx.post(live.base_url + path, content=content, headers={"content-type": content_type})
        assert response.status_code == 400, (path, response.text)
        assert message in response.json()["error"]["message"]
    assert_good_request(client)


@pytest.mark.parametrize(("content", "param"), NON_FINITE_BODIES)
def test_non_finite_number_is_400(
    live: LiveServer, client: openai.OpenAI, content: bytes, param: str
) -> None:
    """NaN and infinities in sampling fields are 400s naming the field."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(
            live.base_url + path, content=content, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["param"] == param
    assert_good_request(client)


def test_unknown_model_and_oversized_body(live: LiveServer, client: openai.OpenAI) -> None:
    """An unknown model is a 404; a body over the default 4 MiB limit is a 413."""
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    huge = httpx.post(
        f"{live.base_url}/v1/completions",
        content=b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}',
        headers={"content-type": "application/json"},
    )
    assert huge.status_code == 413
    assert_good_request(client)


def test_http_layer_limits_answer_in_json(live: LiveServer, model_dir: Path, client: openai.OpenAI) -> None:
    """`pagoda serve` runs the limited protocol: an oversized head is a JSON 431 and malformed HTTP a JSON 400
    (defaults); with --request-head-timeout and --request-body-timeout set, a slow head and a stalled body are
    JSON 408s. A good request succeeds after each."""
    for bad, status in (
        (post_head("/v1/completions", b"X-Big: " + b"v" * 65536 + b"\r\n", 2), 431),
        (b"BAD\r\n\r\n", 400),
    ):
        with connect(live.base_url) as sock:
            sock.sendall(bad + b"{}")
            assert_openai_error(read_response(sock), status)
        assert_good_request(client)
    server = LiveServer(model_dir, "--request-head-timeout", "1", "--request-body-timeout", "1")
    try:
        own = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        for partial in (b"POST /v1/compl", post_head("/v1/completions", b"", 100) + b'{"model"'):
            with connect(server.base_url) as sock:
                sock.sendall(partial)
                assert_openai_error(read_response(sock), 408)
            assert_good_request(own)
    finally:
        assert server.stop() == 0


def test_models_tokenize_detokenize_health(live: LiveServer, client: openai.OpenAI) -> None:
    """The auxiliary routes answer with the real tokenizer."""
    assert [m.id for m in client.models.list().data] == [MODEL]
    tokens = httpx.post(
        f"{live.base_url}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}
    )
    ids = tokens.json()["tokens"]
    assert tokens.json()["count"] == len(ids) > 0
    text = httpx.post(f"{live.base_url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "Hello world"
    chat = httpx.post(f"{live.base_url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["count"] > 2
    assert httpx.get(f"{live.base_url}/health").json() == {"status": "ok"}


@pytest.fixture(scope="module")
def api_schema(live: LiveServer) -> Any:
    """The server's own OpenAPI document, loaded by schemathesis."""
    return schemathesis.openapi.from_url(f"{live.base_url}/openapi.json")


OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
]


# Invalid inputs exist only for operations that take a body.
SCHEMA_CASES = [
    (method, path, mode)
    for method, path in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if method == "POST" or mode is GenerationMode.POSITIVE
]


# Hostile bodies every negative run starts from (issue 18): JSON nested 100,000 deep, a lone surrogate in every
# string field, and fan-out at and past the default caps (2048 prompts, 2048 sequences).
SCHEMA_SEEDS: dict[str, list[bytes]] = {
    path: [body for p, body in NESTED_BODIES if p == path] for _, path in OPERATIONS
}
for _path, _body, _ in SURROGATE_BODIES:
    SCHEMA_SEEDS[_path].append(surrogate_body(_body))
SCHEMA_SEEDS["/v1/completions"] += [
    json.dumps({"prompt": ["a"] * 2048, "max_tokens": 1}).encode(),
    json.dumps({"prompt": ["a"] * 128, "n": 16, "max_tokens": 1}).encode(),
    json.dumps({"prompt": ["a"] * 10_000, "n": 16}).encode(),
]


@pytest.mark.parametrize(("method", "path", "mode"), SCHEMA_CASES)
def test_schemathesis_finds_no_server_error(
    live: LiveServer, api_schema: Any, method: str, path: str, mode: GenerationMode
) -> None:
    """Requests generated from /openapi.json (valid, and invalid, after the hostile seeds) never get a 5xx;
    examples are bounded."""
    operation = api_schema[path][method]

    def check(case: Any) -> None:
        response = case.call(base_url=live.base_url, timeout=120)
        assert response.status_code < 500, (case.body, response.text)

    if mode is GenerationMode.NEGATIVE:
        for seed in SCHEMA_SEEDS[path]:
            check = example(case=operation.Case(body=seed, media_type="application/json"))(check)
    strategy = given(case=operation.as_strategy(generation_mode=mode))
    limits = settings(max_examples=10, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    limits(strategy(check))()


@pytest.mark.parametrize(("path", "content"), NESTED_BODIES, ids=range(len(NESTED_BODIES)))
def test_deeply_nested_json_is_400(
    live: LiveServer, client: openai.OpenAI, path: str, content: bytes
) -> None:
    """JSON nested 100,000 deep, as the body or inside a field, is a 400, and the server keeps serving."""
    response = httpx.post(live.base_url + path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert "nested too deeply" in response.json()["error"]["message"]
    assert_good_request(client)


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_BODIES)
def test_lone_surrogate_is_400_naming_the_field(
    live: LiveServer, client: openai.OpenAI, path: str, body: dict[str, Any], param: str | None
) -> None:
    """A lone surrogate in any string field is a 400 naming the field (the tokenizer raised a TypeError)."""
    content = surrogate_body(body)
    response = httpx.post(live.base_url + path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert_good_request(client)


def test_fan_out_past_the_default_caps_is_400(live: LiveServer, client: openai.OpenAI) -> None:
    """10,000 prompts x n = 16 and 129 prompts x n = 16 are 400s naming prompt and n; 128 x 16 is served."""
    url = f"{live.base_url}/v1/completions"
    huge = httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 10_000, "n": 16}, timeout=60)
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "prompt"
    wide = httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 129, "n": 16}, timeout=60)
    assert wide.status_code == 400 and wide.json()["error"]["param"] == "n"
    body = {"model": MODEL, "prompt": ["a"] * 128, "n": 16, "max_tokens": 1}
    at_cap = httpx.post(url, json=body, timeout=300)
    assert at_cap.status_code == 200 and len(at_cap.json()["choices"]) == 2048
    assert_good_request(client)


def test_health_answers_while_a_4mb_prompt_is_rejected(live: LiveServer, client: openai.OpenAI) -> None:
    """A 4 MB prompt gets its 400 without tokenizing (its length alone exceeds max_model_len) and /health keeps
    answering meanwhile; four at once too."""

    async def scenario() -> tuple[list[httpx.Response], list[float]]:
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"model": MODEL, "prompt": "hello world " * 333_333}
            url = f"{live.base_url}/v1/completions"
            rejected = asyncio.gather(*(http.post(url, json=body) for _ in range(4)))
            latencies: list[float] = []
            while not rejected.done() or not latencies:
                start = time.monotonic()
                assert (await http.get(f"{live.base_url}/health")).status_code == 200
                latencies.append(time.monotonic() - start)
                await asyncio.sleep(0.02)
            return await rejected, latencies

    responses, latencies = asyncio.run(scenario())
    for response in responses:
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        assert "characters" in response.json()["error"]["message"]
    # Generous: tokenizing on the event loop stalled /health for seconds.
    assert max(latencies) < 1.0, max(latencies)
    assert_good_request(client)


def test_sigterm_drains_then_exits_zero(model_dir: Path) -> None:
    """SIGTERM: /health and new requests get 503, a short in-flight request finishes, a long one is aborted
    with finish_reason abort once --shutdown-timeout passes, and the process exits with status 0."""
    server = LiveServer(model_dir, "--max-model-len", "4096", "--shutdown-timeout", "2")
    url = f"{server.base_url}/v1/completions"

    async def scenario() -> tuple[list[str], list[str], httpx.Response, int]:
        async with httpx.AsyncClient(timeout=60) as http:
            started = [asyncio.Event(), asyncio.Event()]

            async def stream(max_tokens: int, started: asyncio.Event) -> list[str]:
                body = {"model": MODEL, "prompt": "go", "max_tokens": max_tokens, "stream": True, **NO_EOS}
                lines = []
                async with http.stream("POST", url, json=body) as response:
                    async for line in response.aiter_lines():
                        if line:
                            lines.append(line)
                            started.set()  # its first token came: the engine holds it
                return lines

            long = asyncio.ensure_future(stream(4000, started[0]))
            short = asyncio.ensure_future(stream(6, started[1]))
            await asyncio.gather(*(event.wait() for event in started))
            server.process.send_signal(signal.SIGTERM)
            while (await http.get(f"{server.base_url}/health")).status_code == 200:
                await asyncio.sleep(0.02)
            refused = await http.post(url, json={"model": MODEL, "prompt": "late", "max_tokens": 1})
            return await long, await short, refused, await asyncio.to_thread(server.process.wait, 60)

    try:
        long, short, refused, status = asyncio.run(scenario())
    finally:
        server.stop()
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "ServiceUnavailableError"
    for lines, reason in ((short, "length"), (long, "abort")):
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == reason
    assert status == 0


def run_bench_serving(live: LiveServer, out: Path, *options: str) -> tuple[str, dict[str, Any]]:
    """Run tools/bench_serving.py against the live server; its stdout and bench_serving.json (it must succeed)."""
    command = [sys.executable, str(ROOT / "tools" / "bench_serving.py"), "--base-url", live.base_url]
    command += ["--model", MODEL, "--ignore-eos", "--settle", "0", "--output-dir", str(out), *options]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "MPLBACKEND": "Agg"}
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads((out / "bench_serving.json").read_text())
    return result.stdout, report


def test_bench_serving_smoke(live: LiveServer, tmp_path: Path) -> None:
    """tools/bench_serving.py runs against the live server and writes its JSON result and plot."""
    stdout, report = run_bench_serving(
        live, tmp_path, "--num-prompts", "6", "--request-rate", "inf", "--input-len", "8", "--output-len", "6"
    )
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["total_output_tokens"] == 36
    assert report["output_throughput"] > 0 and report["mean_ttft_ms"] > 0
    assert (tmp_path / "bench_serving.png").stat().st_size > 0
    assert "Output token throughput" in stdout


def test_bench_serving_shared_prefix_reports_the_hit_rate(live: LiveServer, tmp_path: Path) -> None:
    """The shared-prefix workload against a live server: later requests reuse a system prompt's cached blocks, and
    the hit rate read from /metrics shows it."""
    stdout, report = run_bench_serving(
        live,
        tmp_path,
        *("--label", "one-replica", "--dataset", "shared-prefix", "--num-prefixes", "2"),
        # About 30 tokens of the tiny tokenizer: at least one full 16-token block to share, within MAX_MODEL_LEN.
        *("--prefix-len", "10", "--input-len", "2", "--output-len", "2", "--num-prompts", "6"),
        # One at a time: each request finds its system prompt's blocks already computed.
        *("--max-concurrency", "1"),
    )
    assert report["completed"] == 6 and report["target"] == "one-replica"
    # Requests 3 to 6 hit their system prompt's full blocks (at least 16 tokens each); the first two miss.
    assert report["prefix_cache_hits"] >= 4 * 16 and report["prefix_cache_hits"] % 16 == 0  # whole blocks
    assert 0.0 < report["prefix_cache_hit_rate"] < 1.0
    assert report["prefix_cache_queries"] >= report["total_input_tokens"]
    assert "Prefix cache hit rate" in stdout and "one-replica @ inf" in stdout
