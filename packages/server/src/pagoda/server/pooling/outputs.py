"""What `LLM.embed` returns (vLLM's EmbeddingRequestOutput shape: `output.outputs.embedding`)."""

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
