"""OpenAI's deprecated `functions` / `function_call` chat fields, mapped onto `tools` / `tool_choice` (the calls
come back as `tool_calls`, served by the same tool plan)."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from pagoda.server.api.errors import APIError, bad_request
from pagoda.server.api.protocol import ChatCompletionRequest
from pagoda.server.api.tool_fields import ChatTool, NamedToolChoice
from pydantic import ValidationError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LegacyMapped:
    """A chat body with the legacy fields mapped, and whether it used them (then errors name them)."""

    body: ChatCompletionRequest
    functions: bool = False
    function_call: bool = False

    async def named_errors(self, work: Awaitable[T]) -> T:
        """Await the tool planning; a 400 on tools / tool_choice names functions / function_call when the
        request gave those instead."""
        try:
            return await work
        except APIError as exc:
            renamed = {
                "tools": "functions",
                "tool_choice": "function_call" if self.function_call else "functions",
            }
            if (self.functions or self.function_call) and exc.param in renamed:
                raise bad_request(exc.message, renamed[exc.param]) from exc
            raise


def map_legacy_functions(body: ChatCompletionRequest) -> LegacyMapped:
    """`body` with `functions` as `tools` and `function_call` as `tool_choice`; a 400 naming the field when they
    are malformed or given beside their successors."""
    functions, call = body.functions, body.function_call
    if functions is None and call is None:
        return LegacyMapped(body)
    if functions is not None and body.tools is not None:
        raise bad_request("give tools or the legacy functions, not both", "functions")
    if call is not None and body.tool_choice is not None:
        raise bad_request("give tool_choice or the legacy function_call, not both", "function_call")
    if not isinstance(functions, list | None):
        raise bad_request("functions must be a list of function definitions", "functions")
    tools: list[ChatTool] | None = None
    if functions is not None:
        try:
            tools = [ChatTool.model_validate({"type": "function", "function": f}) for f in functions]
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(part) for part in first["loc"][1:])
            raise bad_request(f"functions: {where}: {first['msg']}", "functions") from exc
    update: dict[str, Any] = {"functions": None, "function_call": None}
    if tools is not None:
        update["tools"] = tools
    if call is not None:
        update["tool_choice"] = _tool_choice(call)
    return LegacyMapped(body.model_copy(update=update), functions is not None, call is not None)


def _tool_choice(call: Any) -> Any:
    """`function_call` ("none", "auto" or {"name": ...}) as a `tool_choice`."""
    if call in ("none", "auto"):
        return call
    if isinstance(call, dict) and set(call) == {"name"} and isinstance(call["name"], str):
        return NamedToolChoice.model_validate({"type": "function", "function": {"name": call["name"]}})
    raise bad_request('function_call must be "none", "auto" or {"name": <function name>}', "function_call")
