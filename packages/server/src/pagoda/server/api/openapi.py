"""The OpenAPI 3.1 document of the server, assembled from the pydantic models' JSON schemas."""

from __future__ import annotations

from typing import Any, Literal

from pagoda.server.api.anthropic_protocol import (
    CountTokensRequest,
    ErrorBody,
    MessageResponse,
    MessagesRequest,
    TokenCount,
)
from pagoda.server.api.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    HealthResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagoda.server.api.responses_protocol import ResponseObject, ResponsesRequest
from pagoda.server.api.score_protocol import (
    RERANK_PATHS,
    SCORE_PATHS,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"
_ERRORS = {
    "400": "Invalid request (bad JSON, wrong content type, out-of-range field, prompt too long).",
    "401": "Missing or wrong API key.",
    "404": "Unknown model.",
    "413": "Request body too large.",
    "429": "Too many waiting requests; see Retry-After.",
    "503": "The server is shutting down or its engine stopped.",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _errors(*codes: str) -> dict[str, Any]:
    return {code: {"description": _ERRORS[code], "content": _json(ErrorResponse)} for code in codes}


def _post(
    summary: str, request: type[BaseModel], response: type[BaseModel], stream: type[BaseModel] | None = None
) -> dict[str, Any]:
    content = _json(response)
    if stream is not None:
        # Streamed responses are server-sent events, one `data: <chunk JSON>` per event, then `data: [DONE]`.
        content["text/event-stream"] = {
            "schema": {"type": "string", "description": f"Server-sent events of {stream.__name__}"}
        }
    errors = (
        ("400", "401", "404", "413", "429", "503") if stream is not None else ("400", "401", "404", "413")
    )
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {"200": {"description": "OK", "content": content}, **_errors(*errors)},
        }
    }


def _anthropic_post(summary: str, request: type[BaseModel], response: type[BaseModel]) -> dict[str, Any]:
    """An Anthropic route: its errors are `ErrorBody`s, and a 503 is Anthropic's 529 (overloaded)."""
    operation = _post(summary, request, response)
    responses = operation["post"]["responses"]
    for code in ("400", "401", "404", "413"):
        responses[code]["content"] = _json(ErrorBody)
    if request is MessagesRequest:  # `stream: true`: Anthropic's named events
        responses["200"]["content"]["text/event-stream"] = {
            "schema": {
                "type": "string",
                "description": "Server-sent events: message_start, content_block_*, "
                "message_delta, message_stop, ping, error",
            }
        }
        responses["429"] = {"description": _ERRORS["429"], "content": _json(ErrorBody)}
        responses["529"] = {"description": _ERRORS["503"], "content": _json(ErrorBody)}
    return operation


def _get(summary: str, content: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    responses.update(extra or {})
    return {"get": {"summary": summary, "responses": responses}}


def _sleep_paths() -> dict[str, Any]:
    """Sleep mode's three routes (vLLM's): 404 without --enable-sleep-mode."""
    off = {"description": "Sleep mode is off (--enable-sleep-mode).", "content": _json(ErrorResponse)}
    empty = {"200": {"description": "Done (an empty body)."}, **_errors("400", "401"), "404": off}
    level = {"name": "level", "in": "query", "schema": {"type": "integer", "enum": [1, 2], "default": 1}}
    tags = {
        "name": "tags",
        "in": "query",
        "schema": {"type": "array", "items": {"type": "string", "enum": ["weights", "kv_cache"]}},
        "description": "What to wake (repeat it); none: everything.",
    }
    state = {
        "type": "object",
        "properties": {"is_sleeping": {"type": "boolean"}},
        "required": ["is_sleeping"],
    }
    return {
        "/sleep": {
            "post": {
                "summary": "Free the KV pool and the weights' memory (once requests in flight finished)",
                "parameters": [level],
                "responses": empty,
            }
        },
        "/wake_up": {"post": {"summary": "Wake the engine", "parameters": [tags], "responses": empty}},
        "/is_sleeping": _get(
            "Whether the engine sleeps",
            {"application/json": {"schema": state}},
            {**_errors("401"), "404": off},
        ),
    }


def build_openapi(*, title: str, version: str, secured: bool) -> dict[str, Any]:
    """The OpenAPI document; `secured` adds the bearer and x-api-key schemes to every route but /health."""
    models: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
        (CompletionRequest, "validation"),
        (ChatCompletionRequest, "validation"),
        (TokenizeRequest, "validation"),
        (DetokenizeRequest, "validation"),
        (EmbeddingRequest, "validation"),
        (EmbeddingResponse, "serialization"),
        (CompletionResponse, "serialization"),
        (ChatCompletionResponse, "serialization"),
        (ChatCompletionChunk, "serialization"),
        (TokenizeResponse, "serialization"),
        (DetokenizeResponse, "serialization"),
        (ModelList, "serialization"),
        (HealthResponse, "serialization"),
        (ErrorResponse, "serialization"),
        (ResponsesRequest, "validation"),
        (ResponseObject, "serialization"),
        (MessagesRequest, "validation"),
        (CountTokensRequest, "validation"),
        (MessageResponse, "serialization"),
        (TokenCount, "serialization"),
        (ErrorBody, "serialization"),
        (ScoreRequest, "validation"),
        (ScoreResponse, "serialization"),
        (RerankRequest, "validation"),
        (RerankResponse, "serialization"),
    ]
    _, schema = models_json_schema(models, ref_template=_REF)
    paths: dict[str, Any] = {
        "/v1/completions": _post(
            "Create a completion", CompletionRequest, CompletionResponse, CompletionResponse
        ),
        "/v1/chat/completions": _post(
            "Create a chat completion", ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk
        ),
        "/v1/responses": _post("Create a response", ResponsesRequest, ResponseObject, ResponseObject),
        "/v1/messages": _anthropic_post(
            "Create a message (Anthropic's Messages API)", MessagesRequest, MessageResponse
        ),
        "/v1/messages/count_tokens": _anthropic_post(
            "Count a message's input tokens (Anthropic's API)", CountTokensRequest, TokenCount
        ),
        "/v1/embeddings": _post(
            "Create embeddings (the pooling runner)", EmbeddingRequest, EmbeddingResponse
        ),
        **{
            path: _post("Score text pairs (the pooling runner)", ScoreRequest, ScoreResponse)
            for path in SCORE_PATHS
        },
        **{
            path: _post("Rank documents against a query (the pooling runner)", RerankRequest, RerankResponse)
            for path in RERANK_PATHS
        },
        "/tokenize": _post("Tokenize a prompt or chat messages", TokenizeRequest, TokenizeResponse),
        "/detokenize": _post("Turn token ids into text", DetokenizeRequest, DetokenizeResponse),
        "/v1/models": _get("List the served model", _json(ModelList), _errors("401")),
        "/health": _get(
            "Liveness of the engine loop",
            _json(HealthResponse),
            {
                "503": {
                    "description": "The engine loop died or the server is draining.",
                    "content": _json(HealthResponse),
                }
            },
        ),
        "/metrics": _get(
            "Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}, _errors("401")
        ),
        "/openapi.json": _get(
            "This document", {"application/json": {"schema": {"type": "object"}}}, _errors("401")
        ),
        **_sleep_paths(),
    }
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": schema.get("$defs", {})},
    }
    if secured:
        document["components"]["securitySchemes"] = {
            "bearerAuth": {"type": "http", "scheme": "bearer"},
            "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "x-api-key"},  # Anthropic's header
        }
        for path, item in paths.items():
            if path != "/health":
                for operation in item.values():
                    operation["security"] = [{"bearerAuth": []}, {"apiKeyHeader": []}]
    return document
