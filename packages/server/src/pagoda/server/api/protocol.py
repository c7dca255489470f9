"""Pydantic models of every request and response body (the OpenAI wire format, plus vLLM's extra fields)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pagoda.server.api.structured_fields import StructuredFields
from pagoda.server.sampling_params import MAX_LOGPROBS
from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # samples per prompt; caps the KV cache one request may claim
MAX_STOP_STRINGS = 16  # stop strings per request; each is checked on every new token
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenIds = list[Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]]


class _Model(BaseModel):
    """Base of request bodies: strict JSON types, no NaN or infinity, unknown fields ignored (as vLLM)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Model):
    """Options of a streamed response."""

    include_usage: bool = False


class SamplingFields(_Model):
    """Sampling fields shared by completions and chat (range checks live in SamplingParams)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None  # -1 or None: disabled
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[TokenIds, Field(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(SamplingFields, StructuredFields):
    """Body of POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: Int64 | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False


class TextContentPart(_Model):
    """A text part of a multi-part message content."""

    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, StructuredFields):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: Int64 | None = None  # None: whatever the context leaves
    max_completion_tokens: Int64 | None = None  # the newer OpenAI name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Model):
    """Body of POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Model):
    """Body of POST /detokenize."""

    model: str | None = None
    tokens: TokenIds


# --- responses -------------------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    """How many prompt tokens came from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Per-token log-probabilities of a completion choice (the legacy completions format)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


FinishReasonField = Literal["stop", "length", "abort"] | None


class CompletionChoice(BaseModel):
    """One generated text of a completion response or stream chunk."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonField = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """Response of POST /v1/completions, and each chunk of its stream."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    """One alternative token at a position (chat format)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """The sampled token at a position and its alternatives (chat format)."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Log-probabilities of a chat choice's content."""

    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    """The generated message of a chat choice."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One generated message of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonField = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """Response of POST /v1/chat/completions."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """What a stream chunk adds to a chat choice."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    """One choice of a chat stream chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonField = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One served model."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagoda"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    """Response of GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    """Response of POST /tokenize."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    """Response of POST /detokenize."""

    prompt: str


class HealthResponse(BaseModel):
    """Response of GET /health."""

    status: Literal["ok", "dead", "draining"]


class ErrorInfo(BaseModel):
    """The body of an OpenAI-shaped error."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error response: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo
