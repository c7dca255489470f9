"""Pydantic models of every request and response body (the OpenAI wire format, plus vLLM's extra fields)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pagoda.server.api.structured_fields import StructuredFields
from pagoda.server.api.template_kwargs import TemplateKwargs
from pagoda.server.api.tool_fields import DeltaToolCall, ToolCall, ToolChoice, Tools
from pagoda.server.sampling_params import MAX_LOGPROBS
from pydantic import BaseModel, ConfigDict, Field, JsonValue

MAX_N = 16  # samples per prompt; caps the KV cache one request may claim
MAX_CACHE_SALT_CHARS = 1024  # the salt is hashed into every block's key: a bound, not a payload
MAX_STOP_STRINGS = 16  # stop strings per request; each is checked on every new token
# Caps on per-request lists (issue 28), each a 400 naming the field. OpenAI's 300 logit_bias keys (counted as
# sent, before "5" and "05" merge into one id); vLLM caps none of these, so the others leave room for what clients
# send today while bounding the work and memory one request may ask for.
MAX_STOP_STRING_CHARS = 1024  # a stream holds back the longest stop string's length - 1 characters
MAX_LOGIT_BIAS_KEYS = 300
MAX_BAD_WORDS = 300
MAX_BAD_WORD_CHARS = 256
# Prompt logprob entries of one request: prompt tokens x (prompt_logprobs + 1), summed over its prompts (a full
# 8,192-token prompt with 20 alternatives is 172,032); each entry is a Python object and ~80 bytes of JSON.
MAX_PROMPT_LOGPROB_ENTRIES = 2**18
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenIds = list[Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]]
StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]
BadWord = Annotated[str, Field(max_length=MAX_BAD_WORD_CHARS)]


class _Model(BaseModel):
    """Base of request bodies: strict JSON types, no NaN or infinity, unknown fields a 400 naming them (as OpenAI;
    vLLM ignores them with a warning in its log, which no client sees)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class _Body(_Model):
    """Base of the completions and chat bodies: extra fields are kept so that the handler can reject each unknown
    one by name (a 400 with `param` set)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    def unknown_fields(self) -> list[str]:
        """The body's fields no model declares, sorted."""
        return sorted(self.model_extra or {})


class StreamOptions(_Model):
    """Options of a streamed response."""

    include_usage: bool = False
    continuous_usage_stats: bool = (
        False  # vLLM extra: with include_usage, every chunk carries the usage so far
    )


class SLOFields(_Model):
    """Pagoda extra `slo`: this request's own objectives in ms (the server's --slo-ttft-ms / --slo-tpot-ms for its
    priority class where absent); the adaptive profile schedules for them."""

    ttft_ms: Annotated[float, Field(gt=0)] | None = None
    tpot_ms: Annotated[float, Field(gt=0)] | None = None


class SamplingFields(_Body):
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
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[TokenIds, Field(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # token id (a JSON key, so a string) -> bias in [-100, 100]
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_KEYS)] | None = None
    allowed_token_ids: TokenIds | None = None  # vLLM extra; at most the vocabulary's size (serving_base)
    bad_words: Annotated[list[BadWord], Field(max_length=MAX_BAD_WORDS)] | None = None  # vLLM extra
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # vLLM extra
    priority: Int64 = 0  # vLLM extra: lower is served first under --scheduling-policy priority
    slo: SLOFields | None = None  # Pagoda extra: {"ttft_ms": ..., "tpot_ms": ...}
    speculative: bool = True  # Pagoda extra: false opts this request out of --speculative-config's drafts
    # vLLM extra: only requests with the same salt (and, by default, the same API key) share cached prefixes.
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # Metadata OpenAI itself stores or bills by: accepted, no effect on generation.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None  # only "auto" and "default" (there is one tier)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache is automatic
    request_id: str | None = None  # vLLM extra; the response keeps Pagoda's own id
    return_tokens_as_token_ids: bool = (
        False  # vLLM extra: logprobs name tokens `token_id:<id>`, not their text
    )
    # Known but not served (yet): a 400 naming the field unless absent, null, or the value that changes nothing.
    functions: JsonValue = None
    function_call: JsonValue = None  # "none" is accepted
    use_beam_search: bool = False
    best_of: Int64 | None = None  # n or null is accepted
    length_penalty: JsonValue = None
    logits_processors: JsonValue = None


class CompletionRequest(SamplingFields, StructuredFields):
    """Body of POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: Int64 | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False  # with logprobs: the prompt tokens' logprobs lead `logprobs` (first one null)
    add_special_tokens: bool = True  # vLLM extra: BOS etc. when tokenizing a text prompt
    suffix: JsonValue = None  # not served: a 400 unless null
    tools: JsonValue = None  # chat only: a 400 unless null or empty
    tool_choice: JsonValue = None  # "none" is accepted
    parallel_tool_calls: JsonValue = None
    # Beam search (vLLM's fields, served on this endpoint only): the beam width is best_of, else n; n <= best_of
    # beams are returned.
    use_beam_search: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False


class TextContentPart(_Model):
    """A text part of a multi-part message content."""

    type: Literal["text"]
    text: str


class ImageURL(_Model):
    """Where an image part's image is: a data: URL, or an http(s):// or file:// URL the server allows."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sizes the image


class ImageContentPart(_Model):
    """An image part of a user message (the bare URL string some clients send for `image_url` is taken too)."""

    type: Literal["image_url"]
    image_url: ImageURL | str

    @property
    def url(self) -> str:
        """The image's URL, whichever form it came in."""
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]


class ChatMessage(_Model):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages: the calls it made
    tool_call_id: str | None = None  # tool messages: the call this result answers


class ChatCompletionRequest(SamplingFields, StructuredFields):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: Int64 | None = None  # None: whatever the context leaves
    max_completion_tokens: Int64 | None = None  # the newer OpenAI name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    tools: Tools | None = None  # rendered by the chat template
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none" (as vLLM)
    parallel_tool_calls: bool | None = None  # false: at most one call per choice
    # Known but not served (yet): a 400 naming the field unless absent, null, or the value that changes nothing.
    audio: JsonValue = None
    modalities: JsonValue = None  # ["text"] is accepted
    prediction: JsonValue = None
    reasoning_effort: JsonValue = None
    verbosity: JsonValue = None
    web_search_options: JsonValue = None
    chat_template: JsonValue = None  # a 400 (vLLM serves it only behind --trust-request-chat-template)
    chat_template_kwargs: TemplateKwargs | None = None  # served: extra variables of the template (bounded)
    continue_final_message: bool = False
    echo: bool = False  # vLLM's chat echo (the last message): a 400 unless false


class TokenizeRequest(_Model):
    """Body of POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: Tools | None = None  # with messages: rendered by the chat template (vLLM's field)
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


FinishReasonField = Literal["stop", "length", "abort", "tool_calls"] | None


class PromptLogprob(BaseModel):
    """One token's entry at a prompt position (vLLM's prompt_logprobs format)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position, keyed by token id: null for the first token (vLLM's extra response field).
PromptLogprobsField = list[dict[str, PromptLogprob] | None] | None


class CompletionChoice(BaseModel):
    """One generated text of a completion response or stream chunk."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonField = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsField = None


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
    content: str | None  # None when the output is all reasoning (--reasoning-parser) or all tool calls
    reasoning_content: str | None = None  # what --reasoning-parser split off (vLLM's field)
    tool_calls: list[ToolCall] = Field(default_factory=list)  # empty without tool calls, as vLLM sends it


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
    prompt_logprobs: PromptLogprobsField = None


class DeltaMessage(BaseModel):
    """What a stream chunk adds to a chat choice."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser, while the model thinks
    tool_calls: list[DeltaToolCall] | None = None  # the calls' starts, then their argument fragments


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
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
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

    status: Literal["ok", "sleeping", "dead", "draining"]
    # Data-parallel serving: replicas started, and those serving now (ok while at least one is).
    replicas: int | None = None
    replicas_alive: int | None = None
    replica_roles: list[str] | None = None  # disaggregated serving: each replica's role ("prefill", "decode")


class ErrorInfo(BaseModel):
    """The body of an OpenAI-shaped error."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error response: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


# POST /v1/embeddings (issue 26): inputs per request are capped by --max-prompts-per-request.
EmbeddingInput = str | list[str] | TokenIds | list[TokenIds]


class EmbeddingRequest(_Model):
    """Body of POST /v1/embeddings (OpenAI's fields, plus vLLM's add_special_tokens)."""

    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None  # a 400 unless the model declares Matryoshka widths
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    add_special_tokens: bool = True  # vLLM extra: BOS etc. when tokenizing a text input


class EmbeddingData(BaseModel):
    """One input's vector: floats, or base64 of its little-endian float32 bytes."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """Token counts of an embeddings request (no completion tokens)."""

    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class EmbeddingResponse(BaseModel):
    """Body of a POST /v1/embeddings answer."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class LoadLoRAAdapterRequest(_Model):
    """Body of POST /v1/load_lora_adapter (vLLM's): serve the PEFT folder `lora_path` as model `lora_name`."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoRAAdapterRequest(_Model):
    """Body of POST /v1/unload_lora_adapter (vLLM's): stop serving `lora_name`."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_int_id: int | None = None  # accepted as vLLM does; the name decides
