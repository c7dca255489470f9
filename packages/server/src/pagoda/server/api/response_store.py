"""The stored responses of /v1/responses: in memory, bounded (least recently used first out), one space per API
key, so that a key can neither read nor continue nor delete another key's responses."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.types import Scope

# Where the API-key middleware leaves the matched key's digest (set whatever the prefix-cache isolation setting).
CALLER_KEY = "pagoda_caller"


def set_caller(scope: Scope, digest: str) -> None:
    """Record which API key made the request (called by the API-key middleware)."""
    scope.setdefault("state", {})[CALLER_KEY] = digest


def request_caller(request: Request) -> str | None:
    """The digest of the API key that made the request; None when the API has no keys (one shared space)."""
    state = request.scope.get("state") or {}
    value = state.get(CALLER_KEY)
    return value if isinstance(value, str) else None


@dataclass(slots=True)
class StoredResponse:
    """One stored response: its object as sent, and the conversation a `previous_response_id` continues."""

    response: dict[str, Any]  # the response object's JSON
    conversation: list[dict[str, Any]]  # chat messages: the input (instructions left out) and the output
    task: asyncio.Task[None] | None = field(default=None)  # a background response still running


class ResponseStore:
    """An LRU map of (caller, response id) -> StoredResponse holding at most `max_entries` responses in all.

    Only the event loop touches it (no lock): the handlers run there.
    """

    def __init__(self, max_entries: int) -> None:
        if max_entries < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {max_entries}")
        self._max = max_entries
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, caller: str | None, response_id: str, entry: StoredResponse) -> None:
        """Store (or replace) a response, evicting the least recently used ones beyond the bound."""
        key = (caller, response_id)
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            _, evicted = self._entries.popitem(last=False)
            if evicted.task is not None:  # an evicted background response has nobody left to read it
                evicted.task.cancel()

    def get(self, caller: str | None, response_id: str) -> StoredResponse | None:
        """The caller's response of that id (now the most recently used), or None."""
        key = (caller, response_id)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def delete(self, caller: str | None, response_id: str) -> StoredResponse | None:
        """Remove the caller's response of that id; the removed entry, or None when there was none."""
        return self._entries.pop((caller, response_id), None)

    def cancel_all(self) -> None:
        """Cancel every background response still running (at shutdown)."""
        for entry in self._entries.values():
            if entry.task is not None:
                entry.task.cancel()
