"""Prefix-cache scopes: the API key's digest and the request's `cache_salt`, folded into one engine cache salt.

Two requests share cached KV blocks only when their salts are equal, so a request salted by its API key's digest
never hits (and, through `cached_tokens`, never learns of) another key's prompts. The key itself never leaves the
front end: its digest is what the engine sees.
"""

from __future__ import annotations

import hashlib
import json

from starlette.requests import Request
from starlette.types import Scope

# Where the API-key middleware leaves the key's digest in the ASGI scope's state (Starlette's `request.state`).
STATE_KEY = "pagoda_cache_scope"


def key_digest(key: bytes) -> str:
    """A stable digest naming the key's cache scope (sha256: the key cannot be recovered from it)."""
    return hashlib.sha256(b"pagoda-prefix-cache\x00" + key).hexdigest()


def set_scope(scope: Scope, digest: str) -> None:
    """Record the caller's cache scope for the handlers (called by the API-key middleware)."""
    scope.setdefault("state", {})[STATE_KEY] = digest


def request_scope(request: Request) -> str | None:
    """The cache scope the middleware recorded for this request, or None (no keys, or sharing configured)."""
    state = request.scope.get("state") or {}
    value = state.get(STATE_KEY)
    return value if isinstance(value, str) else None


def combine(scope: str | None, cache_salt: str | None) -> str | None:
    """The engine's salt for a key scope and a request salt; None when neither is set (the shared cache).

    JSON of the pair, so that no (scope, salt) pair can be spelled like another one.
    """
    if scope is None and cache_salt is None:
        return None
    return json.dumps([scope, cache_salt], separators=(",", ":"))
