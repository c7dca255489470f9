"""Pydantic models of POST /v1/responses: the request body, its input items and tools, and the response object
(OpenAI's Responses wire format, plus a few of vLLM's sampling extras)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pagoda.server.api.protocol import Int64
from pagoda.server.api.response_store import json_bytes
from pagoda.server.api.tool_fields import FUNCTION_NAME, MAX_TOOLS
from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator

MAX_INPUT_ITEMS = 4096  # input items per request: each becomes a message of the rendered conversation
# Bounds on what a stored response echoes back (OpenAI's for metadata; the rest keep a stored response small).
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_USER_CHARS = 10_000  # `user` and `safety_identifier`
MAX_PROMPT_CACHE_KEY_CHARS = 1024
MAX_TOOLS_BYTES = 512 * 1024  # the tool definitions as compact JSON
# OpenAI's built-in tools: Pagoda runs none of them, and says so (a 400 naming the type) instead of ignoring them.
BUILT_IN_TOOLS = (
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "computer_use_preview",
    "computer",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
)


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class InputText(_Model):
    """An `input_text` part of a message's content."""

    type: Literal["input_text"]
    text: str


class InputImage(_Model):
    """An `input_image` part of a user message: a data: URL (or an http(s):// or file:// URL the server allows)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None  # not served (no file store): a 400
    detail: Literal["auto", "low", "high"] | None = None  # accepted and ignored


class OutputText(_Model):
    """An `output_text` part: an earlier assistant message sent back as input."""

    type: Literal["output_text"]
    text: str
    annotations: list[JsonValue] | None = None
    logprobs: list[JsonValue] | None = None


class MessageItem(_Model):
    """A message of the input (`type` may be left out, as the easy-input form does)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Annotated[InputText | InputImage | OutputText, Field(discriminator="type")]]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Model):
    """A call the model made earlier, sent back as input before its output."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Model):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Model):
    """An earlier reasoning item sent back as input: accepted and left out of the prompt (chat templates drop
    past reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[JsonValue] = Field(default_factory=list)
    content: list[JsonValue] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
# Each item's model by its `type` (a message may leave it out); responses_input parses items one by one, so that
# a bad one is a 400 saying which item and field, not every alternative of a union.
INPUT_ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(_Model):
    """A function tool (the Responses API's flat form of chat's `{"type": "function", "function": {...}}`)."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Model):
    """`tool_choice: {"type": "function", "name": ...}`."""

    type: Literal["function"]
    name: str


class TextFormat(_Model):
    """`text.format`: plain text, any JSON object, or JSON matching a named schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", populate_by_name=True)


class TextConfig(_Model):
    """`text`: the output's format."""

    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only value that changes nothing


class ReasoningConfig(_Model):
    """`reasoning`: accepted without an effort (the model reasons as it was trained to; see the README)."""

    effort: None = None
    summary: None = None
    generate_summary: None = None


class ResponsesRequest(_Model):
    """Body of POST /v1/responses. Unknown fields are a 400 naming them; fields known but not served accept only
    the value that changes nothing."""

    model: str | None = None
    input: str | Annotated[list[dict[str, JsonValue]], Field(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=2**31)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None  # vLLM extra
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    tools: Annotated[list[dict[str, JsonValue]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: (
        Annotated[
            dict[
                Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
                Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)],
            ],
            Field(max_length=MAX_METADATA_KEYS),
        ]
        | None
    ) = None
    user: Annotated[str, Field(max_length=MAX_USER_CHARS)] | None = None
    safety_identifier: Annotated[str, Field(max_length=MAX_USER_CHARS)] | None = None
    prompt_cache_key: Annotated[str, Field(max_length=MAX_PROMPT_CACHE_KEY_CHARS)] | None = None
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None
    include: Annotated[list[str], Field(max_length=0)] | None = None
    top_logprobs: Literal[0] | None = None
    # vLLM extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    priority: Int64 = 0
    n: Literal[1] = 1  # one output per response

    @field_validator("tools")
    @classmethod
    def _tools_bytes(cls, tools: list[dict[str, JsonValue]] | None) -> list[dict[str, JsonValue]] | None:
        """The definitions are echoed by every stored response: at most MAX_TOOLS_BYTES of JSON."""
        if tools is not None:
            size = json_bytes(tools)
            if size > MAX_TOOLS_BYTES:
                raise ValueError(
                    f"the tool definitions take {size} bytes as JSON, more than {MAX_TOOLS_BYTES}"
                )
        return tools


def _now() -> int:
    return int(time.time())


class InputTokensDetails(BaseModel):
    """How many input tokens came from the prefix cache."""

    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    """How many output tokens were reasoning."""

    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts of a response."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    """Why a response stopped early."""

    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    """The response object: what POST answers, GET returns and the stream's first and last events carry."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=_now)
    model: str
    status: Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
    output: list[dict[str, Any]] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: JsonValue = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    store: bool = True
    background: bool = False
    user: str | None = None
