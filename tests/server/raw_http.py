"""Raw HTTP/1.1 over a socket, for requests no HTTP client would send: oversized, slow or malformed."""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import urlsplit


def connect(base_url: str) -> socket.socket:
    """A raw TCP connection to the server."""
    address = urlsplit(base_url)
    sock = socket.create_connection((address.hostname or "127.0.0.1", address.port or 80), timeout=30)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Everything the server sends until it closes: (status, headers, body)."""
    data = bytearray()
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def read_one_response(sock: socket.socket) -> tuple[int, bytes]:
    """One Content-Length response on a connection kept alive: (status, body), leaving the connection open."""
    data = bytearray()
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {bytes(data)!r}"
        data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    rest = bytearray(body)
    while len(rest) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection inside a body"
        rest += chunk
    return int(status_line.split()[1]), bytes(rest)


def assert_openai_error(response: tuple[int, dict[str, str], bytes], status: int) -> dict[str, Any]:
    """The response is `status` with an OpenAI-shaped JSON error body; returns the error object."""
    got, headers, body = response
    assert got == status, body
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    error: dict[str, Any] = json.loads(body)["error"]
    assert error["code"] == status and error["message"] and error["type"]
    return error


def post_head(path: str, extra: bytes, length: int) -> bytes:
    """The head of a JSON POST to `path` of `length` body bytes, with `extra` header lines."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n".encode()
        + extra
        + b"\r\n"
    )
