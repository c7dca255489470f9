"""Bodies of POST /score (vLLM's) and POST /rerank (the Jina / Cohere shape vLLM serves), and their answers."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pagoda.server.api.protocol import PromptTokensDetails
from pydantic import BaseModel, ConfigDict, Field

# The paths vLLM serves them on (Jina's and Cohere's clients post to /v1/rerank and /v2/rerank).
SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")


def _now() -> int:
    return int(time.time())


class _Model(BaseModel):
    """Base of the request bodies: strict JSON types, unknown fields a 400 naming them (as every body here)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class ScoreRequest(_Model):
    """Body of POST /score: `text_1` and `text_2`, each a string or a list of strings (see `pair_up`)."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    # vLLM's: False gives a cross-encoder's raw logit instead of its activation (sigmoid); cosines ignore it.
    use_activation: bool | None = None


class ScoreData(BaseModel):
    """One pair's score."""

    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    """Token counts of a score or rerank request: every prompt the engine ran (no completion tokens)."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ScoreResponse(BaseModel):
    """Body of a POST /score answer: one score per pair, in pair order."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankDocumentInput(_Model):
    """A document given as an object (Jina's and Cohere's older clients send `{"text": ...}`)."""

    text: str


class RerankRequest(_Model):
    """Body of POST /rerank (also /v1/rerank, /v2/rerank): documents ranked by their relevance to the query."""

    query: str
    documents: list[str | RerankDocumentInput]
    model: str | None = None
    top_n: Annotated[int, Field(ge=0)] | None = None  # None or 0: every document (vLLM's 0)
    return_documents: bool = True  # Jina's default; false leaves each result's `document` out
    use_activation: bool | None = None  # as in ScoreRequest


class RerankDocument(BaseModel):
    """The ranked document's text."""

    text: str


class RerankResult(BaseModel):
    """One document: its index in the request, its text (with return_documents) and its score."""

    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    """Token counts of a rerank request."""

    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    """Body of a POST /rerank answer: results sorted by relevance_score, highest first."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
