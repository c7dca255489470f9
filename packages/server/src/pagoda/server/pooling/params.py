"""What a pooling runner computes per input: vLLM's `--pooler-config` and per-request `PoolingParams`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from pagoda.server.config_tree import json_object

__all__ = [
    "PoolerConfig",
    "PoolerConfigError",
    "PoolingParams",
    "PoolingTask",
    "PoolingType",
    "RunnerName",
    "SupportedTask",
    "parse_pooler_config",
]

# --runner (vLLM's flag): generate serves completions and chat, pooling serves embeddings.
RunnerName = Literal["generate", "pooling"]
# LAST: the last position's hidden state (vLLM's default for decoder LMs, whose last position has seen every
# token); MEAN: the mean over every position; CLS: the first position's.
PoolingType = Literal["LAST", "MEAN", "CLS"]
# What a pooling request computes (vLLM's task names): `embed`, the pooled vector; `score`, a sequence-classification
# model's score of its prompt (a pair encoded as one, for /score and /rerank): its head on the pooled row.
PoolingTask = Literal["embed", "score"]
# What an engine serves (vLLM's `supported_tasks`): `generate` (completions, chat), `embed` (/v1/embeddings) and
# `score` (/score, /rerank: a cross-encoder's head, or the cosine of two embeddings where `embed` is served too).
SupportedTask = Literal["generate", "embed", "score"]
_POOLER_KEYS = ("pooling_type", "normalize")


class PoolerConfigError(ValueError):
    """A bad --pooler-config; `key` names the key at fault (None: the text is not a JSON object)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How the pooling runner turns hidden states into one vector: the pooling type and L2 normalisation."""

    pooling_type: PoolingType = "LAST"
    normalize: bool = True  # vLLM's embed default: unit vectors, so that a dot product is the cosine

    def __post_init__(self) -> None:
        """PoolerConfigError naming the key."""
        if self.pooling_type not in get_args(PoolingType):
            raise PoolerConfigError(
                f"pooler_config pooling_type must be one of {get_args(PoolingType)}, not {self.pooling_type!r}",
                "pooling_type",
            )
        if not isinstance(self.normalize, bool):
            raise PoolerConfigError(
                f"pooler_config normalize must be true or false, not {self.normalize!r}", "normalize"
            )


def parse_pooler_config(value: str | Mapping[str, object] | PoolerConfig) -> PoolerConfig:
    """The PoolerConfig of --pooler-config's JSON object, of a mapping (`LLM(pooler_config={...})`) or a config as
    is; PoolerConfigError naming the bad or unknown key (or saying the JSON is invalid)."""
    if isinstance(value, PoolerConfig):
        return value
    data: dict[str, Any] = json_object(
        value, "pooler_config", example='{"pooling_type": "MEAN"}', error=PoolerConfigError
    )
    unknown = [key for key in data if key not in _POOLER_KEYS]
    if unknown:
        raise PoolerConfigError(
            f"pooler_config has unknown key {unknown[0]!r} (known: {', '.join(_POOLER_KEYS)})", unknown[0]
        )
    pooling_type = data.get("pooling_type", "LAST")
    if isinstance(pooling_type, str):
        pooling_type = pooling_type.upper()  # vLLM takes "mean" as well as "MEAN"
    return PoolerConfig(pooling_type=pooling_type, normalize=data.get("normalize", True))


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """One pooling request: its task, its Matryoshka width, and the pooling its runner's --pooler-config sets.

    `pooling_type` and `normalize` left None are the engine's (its --pooler-config); the engine fills them at
    admission, so the API front end needs no copy of the engine's config.
    """

    dimensions: int | None = None  # keep the first `dimensions` values (before normalising); None: all
    pooling_type: PoolingType | None = None
    normalize: bool | None = None
    task: PoolingTask = "embed"
    # `score` only (vLLM's use_activation): the head's activation (sigmoid, or none for a regression head) on its
    # logit; False: the raw logit.
    use_activation: bool = True

    def resolved(self, config: PoolerConfig) -> PoolingParams:
        """These params with the runner's pooling type and normalisation where they are None."""
        return PoolingParams(
            self.dimensions,
            config.pooling_type if self.pooling_type is None else self.pooling_type,
            config.normalize if self.normalize is None else self.normalize,
            self.task,
            self.use_activation,
        )

    @property
    def kind(self) -> PoolingType:
        """The pooling type (LAST until resolved)."""
        return self.pooling_type or "LAST"

    @property
    def needs_every_position(self) -> bool:
        """Whether the pooled vector reads positions a prefix-cache hit would skip (MEAN and CLS do; LAST reads
        only the last position, which is always computed)."""
        return self.kind != "LAST"
