"""The HTTP layer over real sockets: head size limits, head and body timeouts, malformed HTTP, all answered in
OpenAI-shaped JSON before the app sees the request; after each, a good request still succeeds.

Slow heads and bodies are sent here, not as schemathesis seeds: schemathesis sends whole requests through an
HTTP client and has no way to pause between the bytes of one request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from api_cases import MODEL
from api_fake_engine import FakeEngine, RunningServer, serve_in_thread
from pagoda.server.config import HTTPLimits
from raw_http import assert_openai_error, connect, post_head, read_one_response, read_response

HEAD_BYTES = 4096
# Short enough to keep the tests quick, long enough that a loaded machine does not trip them by itself.
TIMEOUT = 1.0
LIMITS = HTTPLimits(max_head_bytes=HEAD_BYTES, head_timeout=TIMEOUT, body_timeout=TIMEOUT)
GOOD_BODY = json.dumps({"model": MODEL, "prompt": "ok", "max_tokens": 2}).encode()
JSON = {"content-type": "application/json"}


def completion_head(path: str = "/v1/completions", extra: bytes = b"") -> bytes:
    """The head of a POST of GOOD_BODY."""
    return post_head(path, extra, len(GOOD_BODY))


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """A fake-engine server with small HTTP limits."""
    with serve_in_thread(FakeEngine(), limits=LIMITS) as running:
        yield running


def assert_good_request(server: RunningServer) -> None:
    """A normal completion still succeeds."""
    response = httpx.post(f"{server.base_url}/v1/completions", content=GOOD_BODY, headers=JSON, timeout=30)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (completion_head(extra=b"".join(b"X-Pad-%d: %s\r\n" % (i, b"v" * 1000) for i in range(100))), 431),
        (completion_head(extra=b"X-Big: " + b"v" * 65536 + b"\r\n"), 431),
        (completion_head(path="/v1/completions?" + "q" * 65536), 414),
    ],
    ids=["100KB-of-headers", "64KB-header-value", "64KB-request-line"],
)
def test_oversized_head_is_refused(server: RunningServer, head: bytes, status: int) -> None:
    """A head over --max-request-head-bytes: 431 (414 for the request line), sent in one piece or in parts."""
    for parts in ([head], [head[:1000], head[1000:]]):
        with connect(server.base_url) as sock:
            for part in parts:
                sock.sendall(part)
            sock.sendall(GOOD_BODY)
            error = assert_openai_error(read_response(sock), status)
            assert str(HEAD_BYTES) in error["message"]
    assert_good_request(server)


def test_head_at_the_limit_is_served_one_byte_over_is_not(server: RunningServer) -> None:
    """A head of exactly --max-request-head-bytes reaches the app; one byte more is a 431."""
    base = completion_head(extra=b"Connection: close\r\nX-Pad: \r\n")
    for pad, status in ((HEAD_BYTES - len(base), 200), (HEAD_BYTES - len(base) + 1, 431)):
        head = completion_head(extra=b"Connection: close\r\nX-Pad: " + b"v" * pad + b"\r\n")
        assert len(head) == HEAD_BYTES + (status == 431)
        with connect(server.base_url) as sock:
            sock.sendall(head + GOOD_BODY)
            got, _, body = read_response(sock)
        assert got == status, body
    assert_good_request(server)


def test_slow_head_gets_408(server: RunningServer) -> None:
    """Half a head, then nothing: 408 once --request-head-timeout passes, and the connection closes."""
    with connect(server.base_url) as sock:
        sock.sendall(completion_head()[:30])
        assert_openai_error(read_response(sock), 408)
    assert_good_request(server)


def test_idle_connection_is_closed_without_a_response(server: RunningServer) -> None:
    """A connection that sends nothing is closed after --request-head-timeout, with no bytes sent."""
    with connect(server.base_url) as sock:
        assert sock.recv(65536) == b""
    assert_good_request(server)


def test_kept_alive_connection_outlives_the_head_timeout(server: RunningServer) -> None:
    """Between two requests of one connection the head timer waits for the next head's first byte: a client
    reusing its pooled connection after a pause longer than --request-head-timeout (but under uvicorn's 5 s
    keep-alive) is served, and a head that then stalls still gets its 408."""
    with connect(server.base_url) as sock:
        for _ in range(2):
            sock.sendall(completion_head() + GOOD_BODY)
            status, body = read_one_response(sock)
            assert status == 200, body
            time.sleep(2 * TIMEOUT)
        sock.sendall(completion_head()[:30])
        started = time.monotonic()
        assert_openai_error(read_response(sock), 408)
        assert (
            time.monotonic() - started >= 0.9 * TIMEOUT
        )  # timed from the head's first byte, not the idle start
    assert_good_request(server)


def test_stalled_body_gets_408(server: RunningServer) -> None:
    """Half a body, then nothing: 408 once --request-body-timeout passes, and the connection closes."""
    with connect(server.base_url) as sock:
        sock.sendall(completion_head() + GOOD_BODY[:10])
        error = assert_openai_error(read_response(sock), 408)
        assert "body" in error["message"]
    assert_good_request(server)


def test_slow_but_progressing_body_is_served(server: RunningServer) -> None:
    """A body whose bytes keep coming, taking far longer in all than --request-body-timeout, is served."""
    with connect(server.base_url) as sock:
        sock.sendall(completion_head().replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n"))
        pieces = [GOOD_BODY[i : i + 4] for i in range(0, len(GOOD_BODY), 4)]
        gap = 3 * TIMEOUT / len(pieces)  # the whole body takes 3 timeouts; each gap is far under one
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(gap)
        status, _, body = read_response(sock)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["finish_reason"] == "length"
    assert_good_request(server)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
        b"GET /health HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
    ],
    ids=["garbage", "header-without-colon", "bad-content-length", "no-host"],
)
def test_malformed_http_is_a_json_400(server: RunningServer, request_bytes: bytes) -> None:
    """Malformed HTTP gets an OpenAI-shaped 400, not uvicorn's text/plain one."""
    with connect(server.base_url) as sock:
        sock.sendall(request_bytes)
        assert_openai_error(read_response(sock), 400)
    assert_good_request(server)


def test_unsupported_transfer_encoding_is_a_json_501(server: RunningServer) -> None:
    """A Transfer-Encoding other than chunked: h11's 501, in JSON."""
    with connect(server.base_url) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n")
        assert_openai_error(read_response(sock), 501)
    assert_good_request(server)


def test_keep_alive_connection_serves_two_requests(server: RunningServer) -> None:
    """The timers follow each request on a kept-alive connection: two requests, with a pause, both served."""
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for _ in range(2):
            response = client.post("/v1/completions", content=GOOD_BODY, headers=JSON)
            assert response.status_code == 200
            time.sleep(TIMEOUT / 4)


def test_a_client_gone_before_the_fin_is_one_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    """The FIN of an error response to a client that reset the connection meanwhile (asyncio's write_eof raises
    ENOTCONN): no traceback, one debug line, the transport closed (issue 43, finding 15)."""
    import errno
    import logging

    from pagoda.server.api.http_protocol import write_eof_quietly

    class GoneTransport(asyncio.WriteTransport):
        closed = False

        def write_eof(self) -> None:
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

        def close(self) -> None:
            self.closed = True

    class OpenTransport(GoneTransport):
        def write_eof(self) -> None:
            pass

    gone, open_ = GoneTransport(), OpenTransport()
    with caplog.at_level(logging.DEBUG, logger="pagoda.server.api.http_protocol"):
        assert not write_eof_quietly(gone)
        assert write_eof_quietly(open_)
    assert gone.closed and not open_.closed
    assert [(r.levelno, "not connected" in r.getMessage()) for r in caplog.records] == [(logging.DEBUG, True)]
