"""A small streaming client of the OpenAI API for the command-line clients: server-sent events in, text out.

Kept to httpx (the `openai` package is a test tool here, not a dependency of pagoda-server).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

API_KEY_ENV = "OPENAI_API_KEY"  # read when --api-key is not given, as the openai client does


class ServerError(Exception):
    """The server answered an error (its message), or could not be reached."""


def api_root(url: str) -> str:
    """The /v1 root of `url`, which may name the server (http://h:p) or its API root (http://h:p/v1)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def error_message(response: httpx.Response) -> str:
    """The message of an error response: OpenAI's {"error": {"message"}}, or its status and first bytes."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict) and body["error"].get("message"):
        return f"{response.status_code}: {body['error']['message']}"
    return f"{response.status_code}: {response.text[:200]}"


@dataclass(frozen=True, slots=True)
class Delta:
    """One streamed piece of a reply: text, or reasoning text (with --reasoning-parser)."""

    text: str = ""
    reasoning: str = ""


class StreamingClient:
    """An OpenAI API at `url` (a server or its /v1 root), authenticated by `api_key` (else $OPENAI_API_KEY)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.root = api_root(url)
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # No read timeout while streaming: a long reply on a busy CPU server may pause between tokens.
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, read=None))

    def close(self) -> None:
        """Close the connections."""
        self._http.close()

    def first_model(self) -> str:
        """The first model id /v1/models lists (what `--model` defaults to, as in vLLM's clients)."""
        try:
            response = self._http.get(f"{self.root}/models")
        except httpx.HTTPError as exc:
            raise ServerError(f"cannot reach {self.root}: {exc}") from None
        if response.status_code != 200:
            raise ServerError(f"{self.root}/models answered {error_message(response)}")
        data = response.json().get("data") or []
        if not data:
            raise ServerError(f"{self.root}/models lists no model")
        return str(data[0]["id"])

    def stream_chat(self, body: Mapping[str, Any]) -> Iterator[Delta]:
        """Stream a chat completion (`body` without `stream`): each choice-0 delta's text and reasoning."""
        for event in self._events("/chat/completions", {**body, "stream": True}):
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                if delta.get("content") or reasoning:
                    yield Delta(delta.get("content") or "", reasoning)

    def stream_completion(self, body: Mapping[str, Any]) -> Iterator[str]:
        """Stream a completion (`body` without `stream`): each choice-0 piece of text."""
        for event in self._events("/completions", {**body, "stream": True}):
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    yield str(choice["text"])

    def _events(self, path: str, body: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        """The JSON events of a server-sent event stream; ServerError for an error status or an error event."""
        try:
            with self._http.stream("POST", f"{self.root}{path}", json=dict(body)) as response:
                if response.status_code != 200:
                    response.read()
                    raise ServerError(error_message(response))
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if isinstance(event.get("error"), dict):  # an error mid-stream (e.g. the engine failed)
                        raise ServerError(str(event["error"].get("message")))
                    yield event
        except httpx.HTTPError as exc:
            raise ServerError(f"cannot reach {self.root}: {exc}") from None
