"""POST /sleep, POST /wake_up and GET /is_sleeping (vLLM's endpoints and shapes), with `--enable-sleep-mode`.

`POST /sleep?level=1|2` (default 1) returns once the engine sleeps: it stops admitting requests at once, lets
those in flight finish, frees the KV pool and releases the weights' memory. `POST /wake_up` (optionally
`?tags=weights&tags=kv_cache`, vLLM's tags, to wake one part at a time) returns once what it names is back.
`GET /is_sleeping` answers `{"is_sleeping": bool}`. Both POSTs answer an empty 200, as vLLM's do. Behind the API
key like every route but /health; without `--enable-sleep-mode` each answers 404 naming the flag.
"""

from __future__ import annotations

from collections.abc import Awaitable

from pagoda.server.api.errors import APIError, bad_request
from pagoda.server.api.serving_base import to_api_error
from pagoda.server.async_llm import AsyncLLM
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

_SLEEP_OFF = "sleep mode is off: start the server with --enable-sleep-mode"


def _only(request: Request, *names: str) -> None:
    """A 400 naming a query parameter the endpoint does not take (never ignored)."""
    for name in request.query_params:
        if name not in names:
            raise bad_request(
                f"unknown query parameter {name!r} (accepted: {', '.join(names) or 'none'})", name
            )


async def _engine_call(call: Awaitable[None]) -> None:
    """Await a sleep or wake; its failure as the API's error (a 400 naming the field, a 503 for a dead engine)."""
    try:
        await call
    except Exception as exc:
        error = to_api_error(exc)
        if error is exc:
            raise
        raise error from exc


class SleepRoutes:
    """The three handlers, bound to one app's engine front."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm

    def _check_enabled(self) -> None:
        if not self.llm.sleep_mode:
            raise APIError(404, _SLEEP_OFF)

    async def sleep(self, request: Request) -> Response:
        """POST /sleep?level=1|2."""
        self._check_enabled()
        _only(request, "level")
        text = request.query_params.get("level", "1").strip()
        if not text.isdigit():
            raise bad_request(f"level must be 1 or 2, not {text!r}", "level")
        await _engine_call(self.llm.sleep(int(text)))
        return Response(status_code=200)

    async def wake_up(self, request: Request) -> Response:
        """POST /wake_up (optionally ?tags=weights&tags=kv_cache)."""
        self._check_enabled()
        _only(request, "tags")
        tags = request.query_params.getlist("tags")
        await _engine_call(self.llm.wake_up(tags or None))
        return Response(status_code=200)

    async def is_sleeping(self, request: Request) -> Response:
        """GET /is_sleeping."""
        self._check_enabled()
        _only(request)
        return JSONResponse({"is_sleeping": self.llm.is_sleeping})
