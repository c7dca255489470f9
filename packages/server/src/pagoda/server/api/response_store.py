"""The stored responses of /v1/responses: in memory, one space per API key with its own quota (a count and bytes),
so that a key can neither read nor continue nor delete another key's responses, nor push them out.

Within a key's space the least recently used finished response goes first. A response still being made (a
background one running, or a foreground or streamed one that will be stored when it ends) holds its place and is
never dropped to make room: a new one that does not fit beside them is refused (`StoreFull`) before it starts.
"""

from __future__ import annotations

import asyncio
import json
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


def json_bytes(value: Any) -> int:
    """The size of a value as compact UTF-8 JSON: what a stored response is counted at."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))


@dataclass(slots=True)
class StoredResponse:
    """One stored response: its object as sent, and the conversation a `previous_response_id` continues."""

    response: dict[str, Any]  # the response object's JSON
    conversation: list[dict[str, Any]]  # chat messages: the input (instructions left out) and the output
    task: asyncio.Task[None] | None = field(default=None)  # a background response still running
    # A foreground or streamed response still being made: its place is held, and nobody can see it yet.
    pending: bool = False
    size: int = 0  # json_bytes of response and conversation, as last counted

    @property
    def busy(self) -> bool:
        """Still being made: never dropped to make room."""
        return self.pending or self.task is not None

    def measure(self) -> int:
        """Count (and remember) the bytes this entry holds."""
        self.size = json_bytes(self.response) + json_bytes(self.conversation)
        return self.size


class StoreFull(Exception):
    """A response cannot be stored now: the key's busy responses fill its quota (`transient`), or it can never
    fit (`transient` False: larger than the byte quota alone)."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


@dataclass(slots=True)
class _Space:
    """One key's responses, least recently used first, and the bytes they hold."""

    entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    size: int = 0


class ResponseStore:
    """(caller, response id) -> StoredResponse, at most `max_entries` responses and `max_bytes` bytes per caller.

    Only the event loop touches it (no lock): the handlers run there.
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {max_entries}")
        if max_bytes < 1:
            raise ValueError(f"max_stored_response_bytes must be >= 1, got {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._spaces: dict[str | None, _Space] = {}

    def __len__(self) -> int:
        return sum(len(space.entries) for space in self._spaces.values())

    @property
    def enabled(self) -> bool:
        """False under --max-stored-responses 0: nothing is kept."""
        return self.max_entries > 0

    def held(self, caller: str | None) -> tuple[int, int]:
        """The caller's (responses, bytes) now held."""
        space = self._spaces.get(caller)
        return (0, 0) if space is None else (len(space.entries), space.size)

    def reserve(self, caller: str | None, response_id: str, entry: StoredResponse) -> None:
        """Hold a place for a response about to be made (`entry` busy), dropping the caller's least recently used
        finished ones to make room; StoreFull when its busy ones leave none. Never touches another caller's."""
        if not entry.busy:
            raise ValueError("reserve takes a busy entry (pending or running)")
        size = entry.measure()
        if size > self.max_bytes:
            raise StoreFull(
                f"the response would be stored at {size} bytes, more than the {self.max_bytes} bytes a key may "
                "store (--max-stored-response-bytes)",
                transient=False,
            )
        space = self._spaces.setdefault(caller, _Space())
        busy = [e for e in space.entries.values() if e.busy]
        busy_bytes = sum(e.size for e in busy)
        if len(busy) + 1 > self.max_entries or busy_bytes + size > self.max_bytes:
            if not space.entries:
                del self._spaces[caller]
            raise StoreFull(
                f"this API key's stored responses still in progress ({len(busy)}, {busy_bytes} bytes) leave no "
                f"room for another (--max-stored-responses {self.max_entries}, --max-stored-response-bytes "
                f"{self.max_bytes} per key): retry when one has finished",
                transient=True,
            )
        space.entries[response_id] = entry
        space.size += size
        self._evict(space, keep=response_id)

    def put(self, caller: str | None, response_id: str, entry: StoredResponse) -> None:
        """Store (or replace) a finished or running response, dropping the caller's least recently used finished
        ones beyond the quota (the new one last: it goes only when the caller's busy ones fill the quota)."""
        space = self._spaces.setdefault(caller, _Space())
        old = space.entries.pop(response_id, None)
        if old is not None:
            space.size -= old.size
        space.entries[response_id] = entry
        space.size += entry.measure()
        self._evict(space, keep=None)
        self._drop_if_empty(caller)

    def settle(self, caller: str | None, response_id: str) -> None:
        """Recount a response that changed in place (a background one that ended) and restore the quota."""
        space = self._spaces.get(caller)
        entry = None if space is None else space.entries.get(response_id)
        if entry is not None:  # None: deleted while it ran
            self.put(caller, response_id, entry)

    def release(self, caller: str | None, response_id: str) -> None:
        """Give back the place of a pending response that will not be stored (it failed or its client left)."""
        space = self._spaces.get(caller)
        entry = None if space is None else space.entries.get(response_id)
        if space is not None and entry is not None and entry.pending:
            del space.entries[response_id]
            space.size -= entry.size
            self._drop_if_empty(caller)

    def get(self, caller: str | None, response_id: str) -> StoredResponse | None:
        """The caller's response of that id (now the most recently used), or None (a pending one is not seen)."""
        space = self._spaces.get(caller)
        entry = None if space is None else space.entries.get(response_id)
        if space is None or entry is None or entry.pending:
            return None
        space.entries.move_to_end(response_id)
        return entry

    def delete(self, caller: str | None, response_id: str) -> StoredResponse | None:
        """Remove the caller's response of that id; the removed entry, or None when there was none."""
        space = self._spaces.get(caller)
        entry = None if space is None else space.entries.get(response_id)
        if space is None or entry is None or entry.pending:
            return None
        del space.entries[response_id]
        space.size -= entry.size
        self._drop_if_empty(caller)
        return entry

    def cancel_all(self) -> None:
        """Cancel every background response still running (at shutdown)."""
        for space in self._spaces.values():
            for entry in space.entries.values():
                if entry.task is not None:
                    entry.task.cancel()

    def _evict(self, space: _Space, keep: str | None) -> None:
        """Drop finished responses, least recently used first, until the space is within its quota (or only
        busy ones and `keep` are left)."""
        for response_id in list(space.entries):
            if len(space.entries) <= self.max_entries and space.size <= self.max_bytes:
                return
            entry = space.entries[response_id]
            if entry.busy or response_id == keep:
                continue
            del space.entries[response_id]
            space.size -= entry.size

    def _drop_if_empty(self, caller: str | None) -> None:
        space = self._spaces.get(caller)
        if space is not None and not space.entries:
            del self._spaces[caller]
