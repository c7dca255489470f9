"""Test support for the dashboard: a live server with a key, and a reader of its SSE frames."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

KEY = "sk-dashboard-test-0123456789"


def sse_frames(base_url: str, *, headers: dict[str, str], timeout: float = 120.0) -> Iterator[dict[str, Any]]:
    """Every JSON message of /dashboard/events (the history first), until the caller stops iterating."""
    with (
        httpx.Client(timeout=timeout) as client,
        client.stream("GET", f"{base_url}/dashboard/events", headers=headers) as response,
    ):
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                yield json.loads(line[len("data: ") :])


def wait_for_frame(
    base_url: str, headers: dict[str, str], pred: Callable[[dict[str, Any]], bool], limit: int = 480
) -> dict[str, Any]:
    """The first frame for which `pred` holds (AssertionError after `limit` frames: two minutes at 4/s)."""
    for i, message in enumerate(sse_frames(base_url, headers=headers)):
        if message["type"] == "frame" and pred(message):
            return message
        assert i < limit, f"no matching frame in {limit}; the last: {message}"
    raise AssertionError("the stream ended")


def counts(frame: dict[str, Any], replica: int = 0) -> dict[str, int]:
    """The block counts of one replica of a frame."""
    c: dict[str, int] = frame["replicas"][replica]["counts"]
    return c


def in_background(fn: Callable[[], object]) -> threading.Thread:
    """Run `fn` on a daemon thread (a long request while the test reads frames)."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


@contextmanager
def generating(
    base_url: str, headers: dict[str, str], prompt: str, max_tokens: int, **extra: Any
) -> Iterator[threading.Thread]:
    """A streamed completion of `prompt` (EOS ignored; `extra` body fields) running until the block ends, then
    aborted by closing its connection.

    A request that lasts as long as the test needs it, on any machine: a fixed `max_tokens` of a tiny model can be
    done within one dashboard period on a fast one (what made the dashboard tests flaky), so give it a large one."""
    stop = threading.Event()
    body = {"model": "test-model", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}

    def run() -> None:
        with (
            httpx.Client(timeout=300) as client,
            client.stream(
                "POST", f"{base_url}/v1/completions", json={**body, "stream": True}, headers=headers
            ) as response,
        ):
            assert response.status_code == 200, response.read()
            for _ in response.iter_lines():
                if stop.is_set():
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(120)
