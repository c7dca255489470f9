"""Errors of the Anthropic routes in Anthropic's shape: {"type": "error", "error": {"type", "message"}} with its
status codes, the field at fault named in the message (Anthropic's errors have no `param`)."""

from __future__ import annotations

import json

from pagoda.server.api.anthropic_protocol import ERROR_TYPES, ErrorBody, ErrorDetail
from pagoda.server.api.errors import APIError
from starlette.responses import JSONResponse

ROUTE_PREFIX = "/v1/messages"
OVERLOADED = 529  # Anthropic's status for "try again later": what a 503 (draining, restarting) becomes

# Chat fields the translation fills from Anthropic ones: an error naming one names the Anthropic field.
_FIELDS = {
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "prompt": "messages",
    "input": "messages",
    "chat_template_kwargs": "thinking",
}


def is_anthropic_path(path: str) -> bool:
    """Whether `path` is one of the Anthropic routes, whose errors take Anthropic's shape."""
    return path == ROUTE_PREFIX or path.startswith(ROUTE_PREFIX + "/")


def error_status(status: int) -> int:
    """The HTTP status Anthropic sends for one of ours (503 becomes 529, overloaded)."""
    return OVERLOADED if status == 503 else status


def error_body(error: APIError) -> ErrorBody:
    """The Anthropic body of an error: its type by status, its message naming the field at fault."""
    status = error_status(error.status)
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    message = error.message
    if error.param is not None:
        field = _FIELDS.get(error.param, error.param)
        if not message.startswith(field):
            message = f"{field}: {message}"
    return ErrorBody(error=ErrorDetail(type=kind, message=message))


def error_response(error: APIError) -> JSONResponse:
    """The JSON response of an error on an Anthropic route."""
    return JSONResponse(
        error_body(error).model_dump(), status_code=error_status(error.status), headers=error.headers
    )


def error_event(error: APIError) -> str:
    """The `error` event of a stream that failed after it began."""
    return f"event: error\ndata: {json.dumps(error_body(error).model_dump(), ensure_ascii=False)}\n\n"
