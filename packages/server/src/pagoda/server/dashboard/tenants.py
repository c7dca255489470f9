"""Which API key made each running request, and a frame as one key sees it (#43: the dashboard's tenants).

The API-key middleware sets `CALLER` (the key's digest) for the request's task; `open_streams` records the
engine requests it submits under it (`RequestOwners`). A viewer with the admin key (or on a server without keys)
gets the whole frame; any other key gets the anonymous block map and counts, and only its own requests' queue
rows and block tables.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

# The digest of the key of the request the current task serves (None: no keys, or outside a request). A context
# variable, so each request task (and the tasks it starts, e.g. a background response) sees its own.
CALLER: ContextVar[str | None] = ContextVar("pagoda_caller", default=None)
# Owned request ids kept at most (oldest forgotten first): a bound for a server no viewer prunes.
MAX_OWNED = 16384
# Seconds a request no frame has shown stays owned (one that finished between two frames is never shown).
UNSEEN_S = 60.0
_TABLE_FIELDS = ("tables", "swapped_tables")


@dataclass(slots=True)
class _Owned:
    """One submitted request: its key's digest, when it was submitted, whether a frame has shown it yet."""

    caller: str
    added: float
    seen: bool = False


class RequestOwners:
    """Engine request id -> the digest of the key that submitted it."""

    def __init__(self, limit: int = MAX_OWNED, unseen_s: float = UNSEEN_S) -> None:
        """An empty map of at most `limit` ids; one no frame has shown is forgotten after `unseen_s` seconds."""
        self.limit = limit
        self.unseen_s = unseen_s
        self.by_id: OrderedDict[str, _Owned] = OrderedDict()
        self.missing: set[str] = set()  # ids the last frame did not show

    def add(self, request_ids: Iterable[str], now: float | None = None) -> None:
        """Record the current task's caller (`CALLER`) as the owner of `request_ids` (nothing without one)."""
        caller = CALLER.get()
        if caller is None:
            return
        added = time.monotonic() if now is None else now
        for request_id in request_ids:
            self.by_id[request_id] = _Owned(caller, added)
        while len(self.by_id) > self.limit:
            self.by_id.popitem(last=False)

    def keep_only(self, seq_ids: set[str], now: float | None = None) -> None:
        """Forget the requests no sequence of `seq_ids` (a frame's) belongs to, two frames running, once a frame
        has shown them (a finished request is gone from the queues); one never shown yet is kept `unseen_s`: an
        engine core's map lags its requests by as many periods as the core is slow to answer."""
        now = time.monotonic() if now is None else now
        live = {part for seq_id in seq_ids for part in _request_ids(seq_id)}
        missing = set()
        for request_id, owned in self.by_id.items():
            if request_id in live:
                owned.seen = True
            else:
                missing.add(request_id)
        for request_id in missing & self.missing:
            owned = self.by_id[request_id]
            if owned.seen or now - owned.added > self.unseen_s:
                del self.by_id[request_id]
        self.missing = missing

    def owned_by(self, caller: str) -> set[str]:
        """The request ids `caller` submitted."""
        return {request_id for request_id, owned in self.by_id.items() if owned.caller == caller}


def _request_ids(seq_id: str) -> tuple[str, ...]:
    """The request ids sequence `seq_id` may belong to: itself, or the id before its `:index` / `:beamN`."""
    return (seq_id, seq_id.rsplit(":", 1)[0], seq_id.split(":", 1)[0])


def _owned(seq_id: str, mine: set[str]) -> bool:
    """Whether sequence `seq_id` belongs to one of the request ids `mine`."""
    return any(r in mine for r in _request_ids(seq_id))


def frame_seq_ids(frame: Mapping[str, Any]) -> set[str]:
    """Every sequence id a frame's queues name (what is live in the engine)."""
    return {
        row[0]
        for replica in frame.get("replicas", ())
        for rows in (replica.get("queues") or {}).values()
        for row in rows
    }


def own_view(frame: Mapping[str, Any], mine: set[str]) -> dict[str, Any]:
    """`frame` with only the queue rows and block tables of the request ids `mine` (maps and counts kept)."""
    replicas = []
    for replica in frame.get("replicas", ()):
        out = dict(replica)
        queues = replica.get("queues")
        if queues is not None:
            out["queues"] = {name: [r for r in rows if _owned(r[0], mine)] for name, rows in queues.items()}
        for name in _TABLE_FIELDS:
            if replica.get(name) is not None:
                out[name] = {s: ids for s, ids in replica[name].items() if _owned(s, mine)}
        if replica.get("group_tables") is not None:
            out["group_tables"] = [
                {s: ids for s, ids in tables.items() if _owned(s, mine)} for tables in replica["group_tables"]
            ]
        replicas.append(out)
    return {**frame, "replicas": replicas}
