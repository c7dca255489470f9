"""What `LLM.embed`, `LLM.score` and `LLM.rerank` return (vLLM's shapes: `output.outputs.embedding`,
`output.outputs.score`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    """One input's vector."""

    embedding: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class EmbeddingRequestOutput:
    """One input of `LLM.embed`: its token ids, its vector and how many of its tokens the prefix cache served."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: EmbeddingOutput
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ScoringOutput:
    """One pair's score."""

    score: float


@dataclass(frozen=True, slots=True)
class ScoringRequestOutput:
    """One pair of `LLM.score` (vLLM's shape: `output.outputs.score`): the token ids the engine ran for it (the
    pair's prompt, or both texts' for a cosine), its score and how many of those tokens the prefix cache served."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: ScoringOutput
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RerankOutput:
    """One document of `LLM.rerank`: its index among the documents, its text and its score."""

    index: int
    document: str
    score: float
