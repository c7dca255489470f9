"""Pydantic models of Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, their content
blocks, tools and tool choices, and the message, usage, token count and error bodies sent back.

Content blocks and tools arrive as raw objects and are validated one by one by `api/anthropic_input.py` (as the
Responses API's input items are), so that a bad block is a 400 naming its message, its position and its field
rather than every alternative of a union.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pagoda.server.api.protocol import MAX_STOP_STRINGS, Int64, StopString
from pagoda.server.api.tool_fields import FUNCTION_NAME, MAX_TOOLS
from pydantic import BaseModel, ConfigDict, Field, JsonValue

MAX_MESSAGES = 100_000  # Anthropic's own limit on messages per request
Blocks = list[dict[str, JsonValue]]  # content blocks, validated one by one by anthropic_input

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class _Model(BaseModel):
    """Strict JSON types, no NaN or infinity, unknown fields a 400 naming them."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class CacheControl(_Model):
    """`cache_control` of a block, a tool or the request: accepted; Pagoda's prefix cache is automatic."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Model):
    """A `text` block (messages, `system`, tool results)."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Annotated[list[JsonValue], Field(max_length=0)] | None = None  # none are served


class Base64ImageSource(_Model):
    """An image's bytes in the request (`source.type` base64)."""

    type: Literal["base64"]
    media_type: Literal["image/png", "image/jpeg", "image/webp", "image/gif"]
    data: str


class URLImageSource(_Model):
    """An image by URL (`source.type` url): fetched under the server's media policy."""

    type: Literal["url"]
    url: str


class ImageBlock(_Model):
    """An `image` block of a user message (a vision-language model's input)."""

    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    @property
    def url(self) -> str:
        """The image as a URL the media loader takes (a data URL for base64 bytes)."""
        source = self.source
        if isinstance(source, Base64ImageSource):
            return f"data:{source.media_type};base64,{source.data}"
        return source.url


class DirectCaller(_Model):
    """`caller` of a tool use the model made itself (the only caller here)."""

    type: Literal["direct"]


class ToolUseBlock(_Model):
    """A `tool_use` block of an earlier assistant turn, sent back before its result."""

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: str
    input: dict[str, JsonValue]
    cache_control: CacheControl | None = None
    # What the official client's ToolUseBlock.model_dump() sends back besides: null, or the direct caller.
    caller: DirectCaller | None = None
    toolset_name: None = None


class ToolResultBlock(_Model):
    """A `tool_result` block of a user turn: the output of the call `tool_use_id` names."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | Blocks | None = None  # text blocks (validated by anthropic_input)
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Model):
    """A `thinking` block of an earlier assistant turn: accepted and left out of the prompt."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(_Model):
    """A `redacted_thinking` block of an earlier assistant turn: accepted and left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str


class Message(_Model):
    """One turn of `messages` (a `system` turn is a system message at its place)."""

    role: Literal["user", "assistant", "system"]
    content: str | Blocks


class CustomTool(_Model):
    """A client tool: its name, description and the JSON schema of its input."""

    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    input_schema: dict[str, JsonValue]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # accepted: `any` and `tool` choices always enforce the schema
    # Known, not served: a 400 unless absent or the value that changes nothing (anthropic_input).
    input_examples: JsonValue = None
    defer_loading: JsonValue = None
    allowed_callers: JsonValue = None
    eager_input_streaming: JsonValue = None


class ToolChoice(_Model):
    """`tool_choice`: `auto`, `any`, `tool` (with `name`) or `none`."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Model):
    """`thinking`: `adaptive` (the model thinks as it was trained to) and `disabled` are served."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Int64 | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Model):
    """`output_config.format`: output that matches a JSON schema (structured outputs)."""

    type: Literal["json_schema"]
    json_schema: dict[str, JsonValue] = Field(alias="schema")

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", populate_by_name=True)


class OutputConfig(_Model):
    """`output_config`: `format` is served; `effort` only when null."""

    format: OutputFormat | None = None
    effort: JsonValue = None


class Metadata(_Model):
    """`metadata`: accepted, no effect on generation."""

    user_id: Annotated[str, Field(max_length=512)] | None = None


class PromptFields(_Model):
    """What the prompt is made of: the fields /v1/messages and /v1/messages/count_tokens share."""

    model: str
    messages: Annotated[list[Message], Field(max_length=MAX_MESSAGES)]
    system: str | Blocks | None = None
    tools: Annotated[list[dict[str, JsonValue]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # accepted: the prefix cache is automatic
    # Known, not served: a 400 unless absent or the value that changes nothing (serving_messages).
    speed: JsonValue = None  # "standard" is accepted
    container: JsonValue = None
    context_management: JsonValue = None
    mcp_servers: JsonValue = None


class CountTokensRequest(PromptFields):
    """Body of POST /v1/messages/count_tokens."""


class MessagesRequest(PromptFields):
    """Body of POST /v1/messages."""

    max_tokens: Annotated[int, Field(ge=1, le=2**31)]
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # Anthropic's range
    top_p: float | None = None
    top_k: Int64 | None = None
    metadata: Metadata | None = None
    stream: bool = False
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier: accepted
    inference_geo: JsonValue = None
    diagnostics: JsonValue = None
    # vLLM's sampling extras, as on /v1/responses (Anthropic defines none of them).
    seed: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    priority: Int64 = 0


# --- responses -------------------------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    """Token counts, as Anthropic counts them: `input_tokens` are the prompt tokens not read from the prefix
    cache, `cache_read_input_tokens` those that were (their sum is the prompt's length)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0  # no explicit cache writes: the prefix cache keeps what it computes
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    """The `message` object: POST /v1/messages' answer and the stream's `message_start` payload."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, JsonValue]]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(BaseModel):
    """Answer of POST /v1/messages/count_tokens."""

    input_tokens: int


class ErrorDetail(BaseModel):
    """The `error` of an Anthropic error body."""

    type: str
    message: str


class ErrorBody(BaseModel):
    """Every error of the Anthropic routes: {"type": "error", "error": {"type", "message"}}."""

    type: Literal["error"] = "error"
    error: ErrorDetail


class ModelInfo(BaseModel):
    """One model as Anthropic's `GET /v1/models` lists it."""

    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str  # RFC 3339


class ModelPage(BaseModel):
    """Anthropic's `GET /v1/models` page (all served models on one page)."""

    data: list[ModelInfo]
    has_more: bool = False
    first_id: str | None
    last_id: str | None

    @classmethod
    def of(cls, models: list[tuple[str, int]]) -> ModelPage:
        """The page of (id, created unix seconds) pairs, in order."""
        data = [
            ModelInfo(id=name, display_name=name, created_at=datetime.fromtimestamp(created, UTC).isoformat())
            for name, created in models
        ]
        return cls(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None)
