"""The dashboard's HTTP routes: the page and its two static files, and the SSE stream of frames."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from importlib.resources import files

from pagoda.server.api.admin import is_admin
from pagoda.server.api.response_store import request_caller
from pagoda.server.dashboard.producer import FrameProducer
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

# A comment line every this many seconds without a frame keeps proxies from closing an idle stream.
KEEPALIVE_S = 15.0
_STATIC = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


def _static(name: str) -> Response:
    """A package-data file of the page (read per request: a few KB, and editable in a checkout)."""
    body = files("pagoda.server.dashboard").joinpath("static", name).read_bytes()
    return Response(body, media_type=_STATIC[name], headers={"Cache-Control": "no-cache"})


async def sse_stream(producer: FrameProducer, caller: str | None = None) -> AsyncIterator[str]:
    """The history, then every frame the producer hands this viewer (`caller`: a key's digest, its own requests
    only; None: all of them), until it closes or the viewer leaves."""
    sub = producer.subscribe(caller)
    try:
        yield f"event: history\ndata: {producer.history()}\n\n"
        while True:
            try:
                data = await asyncio.wait_for(sub.next(), KEEPALIVE_S)
            except TimeoutError:
                yield ": keepalive\n\n"
                continue
            if data is None:
                return
            yield f"data: {data}\n\n"
    finally:
        producer.unsubscribe(sub)


def dashboard_routes(producer: FrameProducer) -> list[Route]:
    """GET /dashboard (+ its JS and CSS) and GET /dashboard/events."""

    async def page(request: Request) -> Response:
        return _static("index.html")

    async def script(request: Request) -> Response:
        return _static("dashboard.js")

    async def style(request: Request) -> Response:
        return _static("dashboard.css")

    async def events(request: Request) -> Response:
        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        # The admin key (or a server without keys) sees every tenant's requests; another key its own.
        caller = None if is_admin(request) else request_caller(request) or ""
        stream = sse_stream(producer, caller)
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)

    return [
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/dashboard.js", script, methods=["GET"]),
        Route("/dashboard/dashboard.css", style, methods=["GET"]),
        Route("/dashboard/events", events, methods=["GET"]),
    ]
