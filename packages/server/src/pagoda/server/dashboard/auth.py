"""The dashboard's key handling: a browser can send `Authorization: Bearer`, or the key once as `?api_key=`,
which is taken out of the request (so no log ever shows it), answered with an HttpOnly SameSite=Strict cookie
and a redirect to the clean URL; later page and event requests carry the cookie."""

from __future__ import annotations

from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qsl, urlencode

from starlette.datastructures import Headers
from starlette.responses import RedirectResponse, Response
from starlette.types import Message, Scope, Send

COOKIE_NAME = "pagoda_dashboard_key"
QUERY_PARAM = "api_key"
DASHBOARD_PATH = "/dashboard"


def is_dashboard_path(path: str) -> bool:
    """Whether `path` is the page or one of its resources."""
    return path == DASHBOARD_PATH or path.startswith(DASHBOARD_PATH + "/")


def pop_query_key(scope: Scope) -> str | None:
    """Remove `api_key` from the request's query string (in place: the access log reads it later) and return it."""
    raw: bytes = scope.get("query_string", b"")
    if b"api_key" not in raw:
        return None
    pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True)
    keys = [value for name, value in pairs if name == QUERY_PARAM]
    if not keys:
        return None
    scope["query_string"] = urlencode([(n, v) for n, v in pairs if n != QUERY_PARAM]).encode("latin-1")
    return keys[-1]


def cookie_key(scope: Scope) -> str | None:
    """The key the dashboard cookie carries, if any."""
    header = Headers(scope=scope).get("cookie")
    if not header:
        return None
    cookies: SimpleCookie = SimpleCookie()
    try:
        cookies.load(header)
    except CookieError:
        return None
    morsel = cookies.get(COOKIE_NAME)
    return None if morsel is None else morsel.value


def set_cookie_header(key: str) -> tuple[bytes, bytes]:
    """The Set-Cookie header that keeps `key` for the dashboard's paths, out of reach of scripts."""
    cookie: SimpleCookie = SimpleCookie()
    cookie[COOKIE_NAME] = key
    morsel = cookie[COOKIE_NAME]
    morsel["httponly"] = True
    morsel["samesite"] = "Strict"
    morsel["path"] = DASHBOARD_PATH
    return b"set-cookie", morsel.OutputString().encode("latin-1")


def clean_redirect(scope: Scope, key: str) -> Response:
    """303 to the same path without the key (the query already stripped by `pop_query_key`), setting the cookie."""
    query = scope.get("query_string", b"").decode("latin-1")
    target = scope["path"] + (f"?{query}" if query else "")
    response = RedirectResponse(target, status_code=303)
    name, value = set_cookie_header(key)
    response.raw_headers.append((name, value))
    response.headers["Cache-Control"] = "no-store"
    return response


def with_cookie(send: Send, key: str) -> Send:
    """`send` that adds the dashboard cookie to the response head (a page loaded with a Bearer header)."""

    async def send_with_cookie(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), set_cookie_header(key)]}
        await send(message)

    return send_with_cookie
