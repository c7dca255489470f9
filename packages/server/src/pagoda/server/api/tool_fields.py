"""The request and response models of tool calling: `tools`, `tool_choice`, the calls of assistant messages and
their stream deltas (OpenAI's wire format)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

MAX_TOOLS = 128  # OpenAI's limit; each tool is an alternative of the `required` grammar
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class FunctionDefinition(_Model):
    """A function the model may call: its name, description and JSON schema of its arguments."""

    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any object
    strict: bool | None = None  # accepted; `required` and named choices always enforce the schema


class ChatTool(_Model):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Model):
    """The function a named `tool_choice` forces."""

    name: str


class NamedToolChoice(_Model):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)]


class FunctionCall(_Model):
    """A call's function: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(_Model):
    """One call of an assistant message (in a request's history, and in a response)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    """What a stream chunk adds to a call's function: its name once, then argument fragments."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """What a stream chunk adds to one call: index, id, type and name first, then argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}
