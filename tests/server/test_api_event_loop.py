"""Work kept off the event loop and bounded per connection: large JSON bodies parse on a worker thread while
/health answers, /tokenize has the completions' length bound, a trickled body meets a whole-body deadline, and
connections beyond --limit-concurrency get a 503. Each hostile case is followed by a good request."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from api_cases import MAX_MODEL_LEN, MODEL
from api_fake_engine import FakeEngine, RunningServer, serve_in_thread
from pagoda.server.api import app as app_module
from pagoda.server.config import HTTPLimits
from raw_http import assert_openai_error, connect, post_head, read_response

GOOD_BODY = json.dumps({"model": MODEL, "prompt": "ok", "max_tokens": 2}).encode()
JSON = {"content-type": "application/json"}
# The trickle test's limits: an idle gap it never reaches, and a deadline it does.
GAP = 1.0
DEADLINE = 2.0
CONNECTIONS = 4


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """A fake-engine server with a short body deadline and a small connection cap."""
    limits = HTTPLimits(
        head_timeout=30.0, body_timeout=GAP, body_deadline=DEADLINE, limit_concurrency=CONNECTIONS
    )
    with serve_in_thread(FakeEngine(max_model_len=MAX_MODEL_LEN), limits=limits) as running:
        yield running


def assert_good_request(server: RunningServer) -> None:
    """A normal completion still succeeds."""
    response = httpx.post(f"{server.base_url}/v1/completions", content=GOOD_BODY, headers=JSON, timeout=30)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"


def test_health_answers_while_a_large_body_is_parsed(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body over 256 KB parses on a worker thread: the parse is held until /health has answered, which it
    could never do if the parse ran on the event loop; then the large request itself is served."""
    health_answered = threading.Event()
    parsing = threading.Event()
    held: list[bool] = []
    original = app_module.parse_body

    def slow_parse(body: bytes, model: type[Any]) -> Any:
        if len(body) > app_module.OFF_LOOP_BODY_BYTES:
            parsing.set()
            held.append(health_answered.wait(timeout=10))
        return original(body, model)

    monkeypatch.setattr(app_module, "parse_body", slow_parse)
    padded = GOOD_BODY[:-1] + b" " * (app_module.OFF_LOOP_BODY_BYTES + 1000) + b"}"
    result: list[httpx.Response] = []

    def post() -> None:
        url = f"{server.base_url}/v1/completions"
        result.append(httpx.post(url, content=padded, headers=JSON, timeout=30))

    poster = threading.Thread(target=post)
    poster.start()
    try:
        assert parsing.wait(timeout=30)
        # On the event loop, the held parse would keep this from ever being answered (a timeout error here).
        health = httpx.get(f"{server.base_url}/health", timeout=5)
        assert health.status_code == 200
        health_answered.set()
    finally:
        health_answered.set()
        poster.join(30)
    assert held == [True]
    assert result[0].status_code == 200, result[0].text
    assert_good_request(server)


def test_tokenize_has_the_completions_length_bound(server: RunningServer) -> None:
    """A /tokenize prompt (or rendered chat) too long for max_model_len is a 400 naming the field, not tokenized."""
    url = f"{server.base_url}/tokenize"
    long_text = "a" * (MAX_MODEL_LEN * 4)
    response = httpx.post(url, json={"model": MODEL, "prompt": long_text}, timeout=30)
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["param"] == "prompt"
    messages = [{"role": "user", "content": long_text}]
    response = httpx.post(url, json={"model": MODEL, "messages": messages}, timeout=30)
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["param"] == "messages"
    good = httpx.post(url, json={"model": MODEL, "prompt": "ok"}, timeout=30)
    assert good.status_code == 200 and good.json()["count"] > 0
    assert_good_request(server)


def test_trickled_body_is_cut_off_at_the_deadline(server: RunningServer) -> None:
    """One byte per half gap never trips the idle gap, but the whole body misses --request-body-deadline: 408."""
    with connect(server.base_url) as sock:
        sock.sendall(post_head("/v1/completions", b"", len(GOOD_BODY)))
        sent = 0
        for byte in GOOD_BODY[:-1]:  # never complete: only the deadline can end this
            readable, _, _ = select.select([sock], [], [], GAP / 2)
            if readable:
                break
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            sent += 1
        error = assert_openai_error(read_response(sock), 408)
    assert "within" in error["message"] and f"{DEADLINE:g}" in error["message"]
    assert sent < len(GOOD_BODY) - 1  # cut off before the body could have finished
    assert_good_request(server)


def test_connections_beyond_the_cap_get_503(server: RunningServer) -> None:
    """With --limit-concurrency open connections held, one more request gets uvicorn's 503; once they close,
    requests are served again."""
    held: list[socket.socket] = []
    try:
        for _ in range(CONNECTIONS):
            sock = connect(server.base_url)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a head, unfinished: the connection stays
            held.append(sock)
        status = 0
        for _ in range(50):  # the server accepts the held connections asynchronously
            status = httpx.get(f"{server.base_url}/health", timeout=10).status_code
            if status == 503:
                break
            time.sleep(0.1)
        assert status == 503
    finally:
        for sock in held:
            sock.close()
    for _ in range(50):
        if httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200:
            break
        time.sleep(0.1)
    assert_good_request(server)
