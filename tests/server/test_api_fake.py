"""The API over a deterministic fake engine (in-process uvicorn): formats, streaming, errors, abort, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from api_cases import BAD_CHATS, BAD_COMPLETIONS, MALFORMED_BODIES, MAX_MODEL_LEN, MODEL, NON_FINITE_BODIES
from api_fake_engine import REJECT_MARKER, FakeEngine, RunningServer, make_char_tokenizer, serve_in_thread
from pagoda.server.chat import GEMMA_CHAT_TEMPLATE


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """One server over a fast fake engine for the whole module."""
    with serve_in_thread(FakeEngine(max_model_len=MAX_MODEL_LEN)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    """The official OpenAI client pointed at the server."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def prompt_ids(text: str) -> list[int]:
    """Token ids the server computes for a completions prompt (with <bos>)."""
    ids: list[int] = make_char_tokenizer().encode(text)
    return ids


def metric(text: str, name: str) -> float:
    """The value of an unlabelled-by-us sample `name{model_name=...}` in a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def assert_good_request(client: openai.OpenAI) -> None:
    """The server still serves after a bad request."""
    result = client.completions.create(model=MODEL, prompt="ok", max_tokens=2)
    assert result.choices[0].finish_reason == "length"


def test_completion_text_usage_and_finish_reason(server: RunningServer, client: openai.OpenAI) -> None:
    """A completion returns the engine's text, the usage counts and finish_reason length."""
    result = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0)
    assert result.choices[0].text == server.engine.expected_text(prompt_ids("hello"), 5)
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (
        6,
        5,
        11,
    )
    assert result.usage.prompt_tokens_details is not None
    assert result.usage.prompt_tokens_details.cached_tokens == 0
    assert result.model == MODEL and result.object == "text_completion"


def test_completion_stream_concatenates_to_the_whole_text(
    server: RunningServer, client: openai.OpenAI
) -> None:
    """Streamed deltas add up to the non-streamed text; include_usage adds a final usage chunk."""
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="stream me", max_tokens=7, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == server.engine.expected_text(prompt_ids("stream me"), 7)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7


def test_completion_prompt_forms_and_n(server: RunningServer, client: openai.OpenAI) -> None:
    """Lists of prompts and token-id prompts give one choice per prompt and sample, indexed prompt-major."""
    ids = prompt_ids("abc")
    result = client.completions.create(
        model=MODEL, prompt=[ids, prompt_ids("xyz")], max_tokens=3, n=2, seed=5
    )
    assert [c.index for c in sorted(result.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in result.choices}
    assert by_index[0] == server.engine.expected_text(ids, 3, 0, 5)
    assert by_index[1] == server.engine.expected_text(ids, 3, 1, 5)
    assert by_index[2] == server.engine.expected_text(prompt_ids("xyz"), 3, 0, 5)
    strings = client.completions.create(model=MODEL, prompt=["abc", "xyz"], max_tokens=3, seed=5)
    assert [c.text for c in strings.choices] == [by_index[0], by_index[2]]
    single = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, seed=5)
    assert single.choices[0].text == by_index[0]


def test_many_prompts_enter_the_engine_together() -> None:
    """The prompts of one request are submitted at once: 20 prompts take a few steps, not one step each."""
    engine = FakeEngine(step_seconds=0.01)
    with serve_in_thread(engine) as running:
        result = openai.OpenAI(
            base_url=f"{running.base_url}/v1", api_key="x", max_retries=0
        ).completions.create(model=MODEL, prompt=[f"p{i}" for i in range(20)], max_tokens=2)
        assert len(result.choices) == 20
        assert engine.num_steps <= 6


def test_completion_n_streamed(server: RunningServer, client: openai.OpenAI) -> None:
    """With n = 2 and two prompts a stream carries four choices, each finishing once."""
    chunks = list(client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=4, n=2, stream=True))
    texts: dict[int, str] = {}
    finishes: dict[int, int] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finishes[choice.index] = finishes.get(choice.index, 0) + (choice.finish_reason is not None)
    assert sorted(texts) == [0, 1, 2, 3] and all(len(t) == 4 for t in texts.values())
    assert finishes == {0: 1, 1: 1, 2: 1, 3: 1}


def test_completion_stop_echo_and_logprobs(server: RunningServer, client: openai.OpenAI) -> None:
    """A stop string ends with finish_reason stop; echo prefixes the prompt; logprobs list every token."""
    full = server.engine.expected_text(prompt_ids("q"), 20)
    stop = full[5:7]
    stopped = client.completions.create(model=MODEL, prompt="q", max_tokens=20, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full[: full.find(stop)]
    echoed = client.completions.create(model=MODEL, prompt="q", max_tokens=3, echo=True)
    assert echoed.choices[0].text == "q" + full[:3]
    scored = client.completions.create(model=MODEL, prompt="q", max_tokens=4, logprobs=2)
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens == list(full[:4])
    assert logprobs.token_logprobs == [-0.5] * 4
    assert logprobs.top_logprobs is not None and all(len(t) == 2 for t in logprobs.top_logprobs)
    assert logprobs.text_offset == [0, 1, 2, 3]


def test_chat_uses_the_gemma_fallback_template(server: RunningServer, client: openai.OpenAI) -> None:
    """A tokenizer without a template but with Gemma's markers renders chats with the built-in template."""
    messages: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    rendered = make_char_tokenizer().apply_chat_template(
        messages, chat_template=GEMMA_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<bos><start_of_turn>user\nbe brief\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    ids = make_char_tokenizer().encode(rendered, add_special_tokens=False)
    assert result.choices[0].message.content == server.engine.expected_text(ids, 4)
    assert result.choices[0].message.role == "assistant"
    assert result.usage is not None and result.usage.prompt_tokens == len(ids)


def test_chat_default_max_tokens_fills_the_context(server: RunningServer, client: openai.OpenAI) -> None:
    """Without max_tokens a chat may use the whole remaining context."""
    result = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert result.usage is not None
    assert result.usage.prompt_tokens + result.usage.completion_tokens == MAX_MODEL_LEN
    assert result.choices[0].finish_reason == "length"


def test_chat_stream_role_content_finish_usage(client: openai.OpenAI) -> None:
    """A chat stream sends the role first, content deltas, one finish chunk, then the usage chunk."""
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "stream"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            n=2,
            logprobs=True,
            top_logprobs=1,
        )
    )
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert len("".join(c.delta.content or "" for c in mine)) == 5
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
        assert mine[-1].finish_reason == "length"
        tokens = [t for c in mine if c.logprobs and c.logprobs.content for t in c.logprobs.content]
        assert len(tokens) == 5 and all(len(t.top_logprobs) == 1 for t in tokens)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_async_client_concurrent_requests_match_sequential(server: RunningServer) -> None:
    """Concurrent streamed requests each get exactly the text the engine gives them alone."""

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)

        async def one(i: int) -> str:
            stream = await client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=6, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await client.close()

    texts = asyncio.run(run())
    assert texts == [server.engine.expected_text(prompt_ids(f"p{i}"), 6) for i in range(16)]


def test_models_tokenize_detokenize(server: RunningServer, client: openai.OpenAI) -> None:
    """/v1/models lists the served name; /tokenize and /detokenize round-trip."""
    assert [m.id for m in client.models.list().data] == [MODEL]
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "hi"}).json()
    assert tokens == {"count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": prompt_ids("hi")}
    chat = httpx.post(f"{server.base_url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.json()["tokens"][:2] == [1, 4]  # <bos> <start_of_turn>
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": prompt_ids("hi")[1:]}).json()
    assert text == {"prompt": "hi"}


@pytest.mark.parametrize(("body", "param"), [*BAD_COMPLETIONS, ({"prompt": REJECT_MARKER}, "prompt")])
def test_bad_completion_is_400_naming_the_field(
    server: RunningServer, client: openai.OpenAI, body: dict[str, Any], param: str | None
) -> None:
    """Each bad field gives an OpenAI-shaped 400 naming it; the server serves the next request."""
    response = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["type"] == "BadRequestError"
    assert "Traceback" not in error["message"]
    assert_good_request(client)


@pytest.mark.parametrize(("body", "param"), BAD_CHATS)
def test_bad_chat_is_400(
    server: RunningServer, client: openai.OpenAI, body: dict[str, Any], param: str | None
) -> None:
    """Bad chat bodies give a 400 naming the field; the server serves the next request."""
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert_good_request(client)


@pytest.mark.parametrize(("content", "content_type", "message"), MALFORMED_BODIES)
def test_malformed_bodies_are_400(
    server: RunningServer, client: openai.OpenAI, content: bytes, content_type: str, message: str
) -> None:
    """Malformed JSON, non-object bodies, NaN and a wrong content type are 400s."""
    response = httpx.post(
        f"{server.base_url}/v1/completions", content=content, headers={"content-type": content_type}
    )
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
    assert_good_request(client)


@pytest.mark.parametrize(("content", "param"), NON_FINITE_BODIES)
def test_non_finite_number_is_400(
    server: RunningServer, client: openai.OpenAI, content: bytes, param: str
) -> None:
    """NaN and infinities in sampling fields are 400s naming the field."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(
            server.base_url + path, content=content, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert_good_request(client)


def test_unknown_model_route_and_method(server: RunningServer, client: openai.OpenAI) -> None:
    """An unknown model is 404 with param model; unknown routes and methods are OpenAI-shaped too."""
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    assert info.value.status_code == 404
    assert httpx.get(f"{server.base_url}/nowhere").json()["error"]["code"] == 404
    assert httpx.get(f"{server.base_url}/v1/completions").json()["error"]["code"] == 405
    assert_good_request(client)


def test_body_over_the_limit_is_413() -> None:
    """A body over the configured limit is a 413, whether declared or streamed in chunks."""
    from pagoda.server.api import AppSettings

    with serve_in_thread(FakeEngine(), settings=AppSettings(max_body_bytes=1000)) as running:
        url = f"{running.base_url}/v1/completions"
        big = json.dumps({"model": MODEL, "prompt": "x" * 2000}).encode()
        assert httpx.post(url, content=big, headers={"content-type": "application/json"}).status_code == 413

        def chunks() -> Iterator[bytes]:
            yield big[:600]
            yield big[600:]

        chunked = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
        assert chunked.status_code == 413
        assert chunked.json()["error"]["type"] == "RequestTooLargeError"
        good = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert good.status_code == 200


ROUTES = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/score"),
    ("POST", "/v1/score"),
    ("POST", "/rerank"),
    ("POST", "/v1/rerank"),
    ("POST", "/v2/rerank"),
    ("GET", "/v1/models"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
]
# Sleep mode's routes, which answer 404 (naming the flag) on a server without --enable-sleep-mode.
SLEEP_PATHS = {"/sleep", "/wake_up", "/is_sleeping"}


def test_api_key_protects_every_route_but_health() -> None:
    """With an API key every route answers 401 without the right bearer token or x-api-key; /health stays
    open."""
    from pagoda.server.api import AppSettings

    with serve_in_thread(FakeEngine(), settings=AppSettings(api_key="sekret")) as running:
        openapi_paths = set(
            httpx.get(f"{running.base_url}/openapi.json", headers=_bearer("sekret")).json()["paths"]
        )
        assert openapi_paths == {path for _, path in ROUTES} | {"/health"}
        for method, path in ROUTES:
            wrong: tuple[dict[str, str], ...] = (
                {},
                _bearer("wrong"),
                _bearer("sekre"),
                {"authorization": "Basic sekret"},
                {"x-api-key": "x"},
            )
            for headers in wrong:
                response = httpx.request(method, running.base_url + path, headers=headers)
                assert response.status_code == 401, (method, path, headers)
                error = response.json()["error"]
                # The Anthropic routes answer in Anthropic's shape (tests/server/test_anthropic_api.py).
                anthropic = path.startswith("/v1/messages")
                assert error["type"] == ("authentication_error" if anthropic else "AuthenticationError")
            # With the key (Bearer, or Anthropic's x-api-key) the request gets past the check (a body-less POST
            # is then a 400; the sleep routes are 404s without --enable-sleep-mode).
            for headers in (_bearer("sekret"), {"x-api-key": "sekret"}):
                allowed = httpx.request(method, running.base_url + path, headers=headers)
                assert allowed.status_code in ({404} if path in SLEEP_PATHS else {200, 400}), (method, path)
        assert httpx.get(f"{running.base_url}/health").status_code == 200
        keyed = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="sekret", max_retries=0)
        assert_good_request(keyed)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="nope", max_retries=0).models.list()


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_full_waiting_queue_is_429_with_retry_after() -> None:
    """With one seat and a waiting limit of 2 sequences, a burst gets 429s with Retry-After; n counts n."""
    engine = FakeEngine(max_num_seqs=1, step_seconds=0.005)
    with serve_in_thread(engine, max_waiting_requests=2) as running:
        url = f"{running.base_url}/v1/completions"

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": MODEL, "prompt": "long", "max_tokens": 100}
                return await asyncio.gather(*(client.post(url, json=body) for _ in range(8)))

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert 200 in codes and 429 in codes and set(codes) == {200, 429}
        rejected = next(r for r in responses if r.status_code == 429)
        assert rejected.headers["retry-after"] == "1"
        assert rejected.json()["error"]["type"] == "RateLimitError"

        # One request runs (it has tokens), one waits: a request with n = 2 makes 1 + 2 > 2 sequences.
        async def with_n() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as client:
                running_one = asyncio.ensure_future(
                    client.post(url, json={"model": MODEL, "prompt": "a", "max_tokens": 100})
                )
                await _until(
                    lambda: running.llm.num_active_requests == 1 and running.llm.num_pending_sequences == 0
                )
                waiting_one = asyncio.ensure_future(
                    client.post(url, json={"model": MODEL, "prompt": "b", "max_tokens": 2})
                )
                await _until(lambda: running.llm.num_pending_sequences == 1)
                two = await client.post(url, json={"model": MODEL, "prompt": "c", "max_tokens": 2, "n": 2})
                one = asyncio.ensure_future(
                    client.post(url, json={"model": MODEL, "prompt": "d", "max_tokens": 2})
                )
                return [two.status_code, *[(await r).status_code for r in (running_one, waiting_one, one)]]

        assert asyncio.run(with_n()) == [429, 200, 200, 200]
        # The rule counts sequences (prompts x n) for every request: one that exceeds the limit alone can never
        # be admitted, so it is a 400 even on an idle server; one at the limit is admitted there.
        too_wide = httpx.post(url, json={"model": MODEL, "prompt": "a", "max_tokens": 2, "n": 3})
        assert too_wide.status_code == 400 and too_wide.json()["error"]["param"] == "n"
        assert "never" in too_wide.json()["error"]["message"]
        assert (
            httpx.post(url, json={"model": MODEL, "prompt": "a", "max_tokens": 2, "n": 2}).status_code == 200
        )


def test_max_concurrent_requests_is_429_in_flight_and_400_alone() -> None:
    """TGI's --max-concurrent-requests 2: with two prompts in flight a third is a 429; a request of three
    prompts can never fit (400); once the two finish a request is admitted again."""
    engine = FakeEngine(max_num_seqs=4, step_seconds=0.005)
    with serve_in_thread(engine, max_concurrent_requests=2) as running:
        url = f"{running.base_url}/v1/completions"

        async def scenario() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": MODEL, "prompt": "a", "max_tokens": 30}
                first = asyncio.ensure_future(client.post(url, json=body))
                second = asyncio.ensure_future(client.post(url, json=body))
                await _until(lambda: running.llm.num_active_requests == 2)
                third = await client.post(url, json={**body, "max_tokens": 2})
                three_prompts = await client.post(url, json={**body, "prompt": ["a", "b", "c"]})
                codes = [third.status_code, three_prompts.status_code, (await first).status_code]
                codes.append((await second).status_code)
                after = await client.post(url, json={**body, "max_tokens": 2})
                return [*codes, after.status_code]

        assert asyncio.run(scenario()) == [429, 400, 200, 200, 200]


async def _until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.001)


def _wait_idle(running: RunningServer) -> str:
    """Wait until the engine holds no request; return /metrics then."""
    deadline = time.monotonic() + 10
    while running.engine.requests or running.llm.num_active_requests:
        assert time.monotonic() < deadline, "requests still held"
        time.sleep(0.01)
    time.sleep(0.05)  # the engine thread refreshes its stats after applying the abort
    return httpx.get(f"{running.base_url}/metrics").text


def test_client_disconnect_aborts_streaming_and_non_streaming() -> None:
    """Clients that leave abort their engine requests; metrics then show nothing running and no KV use."""
    engine = FakeEngine(max_model_len=4096, step_seconds=0.002)
    with serve_in_thread(engine) as running:
        url = f"{running.base_url}/v1/completions"
        body = {"model": MODEL, "prompt": "go", "max_tokens": 4000}
        with httpx.Client() as client:
            with client.stream("POST", url, json={**body, "stream": True}) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
            for _ in range(5):
                with pytest.raises(httpx.ReadTimeout):
                    client.post(url, json=body, timeout=0.2)
        text = _wait_idle(running)
        assert len(engine.aborted) == 6
        assert metric(text, "pagoda:num_requests_running") == 0
        assert metric(text, "pagoda:num_requests_waiting") == 0
        assert metric(text, "pagoda:kv_cache_usage_perc") == 0
        assert httpx.post(url, json={**body, "max_tokens": 2}).status_code == 200


def test_client_leaving_mid_body_is_not_a_server_error(
    server: RunningServer, client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that closes while sending its body is not logged as a server error; serving goes on."""
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": '
        )
        time.sleep(0.1)  # let the server start reading the body before the connection drops
    assert_good_request(client)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_metrics_names_and_counts(server: RunningServer, client: openai.OpenAI) -> None:
    """/metrics exposes vLLM's names with the pagoda: prefix and counts generated tokens."""
    before = httpx.get(f"{server.base_url}/metrics").text
    client.completions.create(model=MODEL, prompt="count", max_tokens=3)
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in [
        "pagoda:num_requests_running",
        "pagoda:num_requests_waiting",
        "pagoda:kv_cache_usage_perc",
        "pagoda:prefix_cache_queries_total",
        "pagoda:prefix_cache_hits_total",
        "pagoda:num_preemptions_total",
        "pagoda:prompt_tokens_total",
        "pagoda:generation_tokens_total",
        "pagoda:time_to_first_token_seconds_count",
        "pagoda:inter_token_latency_seconds_count",
        "pagoda:e2e_request_latency_seconds_count",
    ]:
        assert f"{name}{{" in text, name
    gained = metric(text, "pagoda:generation_tokens_total") - metric(before, "pagoda:generation_tokens_total")
    assert gained == 3
    assert metric(text, "pagoda:e2e_request_latency_seconds_count") > metric(
        before, "pagoda:e2e_request_latency_seconds_count"
    )
    assert (
        metric(text, "pagoda:inter_token_latency_seconds_count")
        - metric(before, "pagoda:inter_token_latency_seconds_count")
        == 2
    )


def test_openapi_document_resolves(server: RunningServer) -> None:
    """/openapi.json is OpenAPI 3.1 and every $ref points at a component schema."""
    document = httpx.get(f"{server.base_url}/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    schemas = document["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "ErrorResponse"} <= set(schemas)
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                refs.append(node["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(document)
    assert refs and all(ref.removeprefix("#/components/schemas/") in schemas for ref in refs)


def test_engine_failure_fails_in_flight_and_turns_health_503() -> None:
    """A step that raises fails every in-flight request, /health turns 503, new requests fail fast."""
    from api_fake_engine import FAIL_STEP_MARKER

    engine = FakeEngine(step_seconds=0.01)
    with serve_in_thread(engine) as running:
        url = f"{running.base_url}/v1/completions"
        assert httpx.get(f"{running.base_url}/health").status_code == 200

        async def run() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                bystander = asyncio.ensure_future(
                    client.post(url, json={"model": MODEL, "prompt": "bystander", "max_tokens": 100})
                )
                await _until(lambda: running.llm.num_active_requests == 1)
                culprit = await client.post(
                    url, json={"model": MODEL, "prompt": FAIL_STEP_MARKER, "max_tokens": 5}
                )
                return await bystander, culprit

        bystander, culprit = asyncio.run(run())
        assert bystander.status_code == 503 and culprit.status_code == 503
        assert "Traceback" not in culprit.text
        health = httpx.get(f"{running.base_url}/health")
        assert health.status_code == 503 and health.json() == {"status": "dead"}
        after = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert after.status_code == 503
        streamed = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "stream": True})
        assert streamed.status_code == 503


def test_drain_finishes_or_aborts_in_flight_and_refuses_new() -> None:
    """Draining refuses new requests with 503 and ends the in-flight ones with finish_reason abort."""
    engine = FakeEngine(max_model_len=4096, step_seconds=0.002)
    with serve_in_thread(engine) as running:
        url = f"{running.base_url}/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000}

        async def run() -> tuple[list[str], httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:

                async def stream() -> list[str]:
                    async with client.stream("POST", url, json={**body, "stream": True}) as response:
                        return [line async for line in response.aiter_lines() if line]

                streaming = asyncio.ensure_future(stream())
                plain = asyncio.ensure_future(client.post(url, json=body))
                await _until(lambda: running.llm.num_active_requests == 2)
                drain = asyncio.run_coroutine_threadsafe(running.llm.drain(0.1), _loop_of(running))
                await _until(lambda: running.llm.is_draining)
                refused = await client.post(url, json={**body, "max_tokens": 1})
                await asyncio.wrap_future(drain)
                return await streaming, await plain, refused

        lines, plain, refused = asyncio.run(run())
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "ServiceUnavailableError"
        assert plain.json()["choices"][0]["finish_reason"] == "abort"
        assert lines[-1] == "data: [DONE]"
        finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in lines[:-1]]
        assert finish[-1] == "abort"
        assert httpx.get(f"{running.base_url}/health").status_code == 503


def _loop_of(running: RunningServer) -> asyncio.AbstractEventLoop:
    loop = running.llm._loop
    assert loop is not None
    return loop


def test_a_requests_slo_reaches_the_engine_and_metrics_show_the_step_shape_and_attainment(
    server: RunningServer, client: openai.OpenAI
) -> None:
    """The body's "slo" becomes SamplingParams.slo; /metrics has the step-shape gauges and SLO counters."""
    from pagoda.scheduler import RequestSLO

    client.completions.create(
        model=MODEL, prompt="ok", max_tokens=2, extra_body={"slo": {"ttft_ms": 500, "tpot_ms": 40.5}}
    )
    assert server.engine.last_params is not None
    assert server.engine.last_params.slo == RequestSLO(ttft_ms=500.0, tpot_ms=40.5)
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"slo": {"tpot_ms": 9}},
    )
    assert server.engine.last_params.slo == RequestSLO(tpot_ms=9.0)
    text = httpx.get(f"{server.base_url}/metrics").text
    assert metric(text, "pagoda:scheduler_token_budget") == 64.0
    assert metric(text, "pagoda:scheduler_chunk_size") == 32.0
    assert 'pagoda:slo_met_total{model_name="test-model",priority="0",slo="ttft"} 3.0' in text
    assert 'pagoda:slo_requests_total{model_name="test-model",priority="0",slo="tpot"} 4.0' in text
    assert 'pagoda:slo_sacrificed_total{model_name="test-model",slo="ttft"} 5.0' in text
