"""Admin keys (`--admin-api-key`): which requests came with one, and the 403 of an admin-only action.

The API-key middleware records, per request, whether its key is an admin key. A server with no keys at all is
open, and every caller there counts as the admin (there is no tenant to keep apart).
"""

from __future__ import annotations

from pagoda.server.api.errors import APIError
from starlette.requests import Request
from starlette.types import Scope

# Where the API-key middleware leaves the verdict in the ASGI scope's state (Starlette's `request.state`).
STATE_KEY = "pagoda_admin"


def set_admin(scope: Scope, admin: bool) -> None:
    """Record whether the request's key is an admin key (called by the API-key middleware)."""
    scope.setdefault("state", {})[STATE_KEY] = admin


def is_admin(request: Request | Scope) -> bool:
    """Whether the request came with an admin key, or to a server without keys (no middleware ran)."""
    scope = request.scope if isinstance(request, Request) else request
    state = scope.get("state") or {}
    value = state.get(STATE_KEY, True)  # absent only when the API is open: the middleware always sets it
    return value is True


def require_admin(request: Request, action: str) -> None:
    """403 unless the request came with an admin key."""
    if not is_admin(request):
        raise APIError(403, f"{action} needs an admin API key (--admin-api-key).")
