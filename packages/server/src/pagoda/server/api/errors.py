"""OpenAI-shaped errors: one exception type carrying the HTTP status, and the JSON response it becomes."""

from __future__ import annotations

from http import HTTPStatus

from pagoda.server.api.protocol import ErrorInfo, ErrorResponse
from starlette.responses import JSONResponse

# The OpenAI `type` of each status we send.
_ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error to send to the client as {"error": {...}} with the given HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # A message may quote client text; a lone surrogate in it could not be encoded into the response.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def to_model(self) -> ErrorResponse:
        """The pydantic body of this error."""
        error_type = _ERROR_TYPES.get(self.status) or HTTPStatus(self.status).phrase.replace(" ", "")
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=error_type, param=self.param, code=self.status)
        )

    def to_response(self) -> JSONResponse:
        """The JSON response of this error."""
        return JSONResponse(self.to_model().model_dump(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 error naming the offending field."""
    return APIError(400, message, param=param)


# The 503 texts clients see: stable, never an exception's text (the server log has that).
ENGINE_RESTARTED_MESSAGE = (
    "The engine failed while serving this request and is being restarted. Retry the request."
)
REPLICA_FAILED_MESSAGE = "The engine replica serving this request failed. Retry the request."
ENGINE_DEAD_MESSAGE = "The engine has stopped; the server cannot serve requests."
ENGINE_SLEEPING_MESSAGE = (
    "The engine is sleeping (sleep mode): retry once it woke (POST /wake_up), or start the server with "
    "--wake-on-request."
)
