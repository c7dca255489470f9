"""The engine's pooling rules: which runner and model serve which request, and the Matryoshka widths a model
declares."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from pagoda.scheduler import RequestRejectedError
from pagoda.server.pooling.classifier import ScoreHead
from pagoda.server.pooling.params import PoolerConfig, RunnerName, SupportedTask
from pagoda.server.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Matryoshka:
    """The output widths a model declares it was trained to be cut to (config.json, as vLLM reads it)."""

    dimensions: tuple[int, ...] | None  # `matryoshka_dimensions`; None: any width up to hidden_size
    hidden_size: int

    @classmethod
    def of_model(cls, model_path: Path) -> Matryoshka | None:
        """The declaration in the model folder's config.json; None when it declares none."""
        config_file = model_path / "config.json"
        if not config_file.is_file():
            return None
        config = json.loads(config_file.read_text(encoding="utf-8"))
        hidden = int(config.get("hidden_size") or config.get("text_config", {}).get("hidden_size") or 0)
        dims = config.get("matryoshka_dimensions")
        if isinstance(dims, list) and dims:
            return cls(tuple(int(d) for d in dims), hidden)
        return cls(None, hidden) if config.get("is_matryoshka") is True else None

    def check(self, dimensions: int) -> None:
        """RequestRejectedError naming `dimensions` when the model was not trained for that width."""
        allowed = self.dimensions
        if allowed is not None and dimensions not in allowed:
            raise RequestRejectedError(
                f"dimensions {dimensions} is not one of the model's Matryoshka dimensions {list(allowed)}",
                "dimensions",
            )
        if not 1 <= dimensions <= self.hidden_size:
            raise RequestRejectedError(
                f"dimensions must be between 1 and the model's hidden size {self.hidden_size}, got {dimensions}",
                "dimensions",
            )


def runner_message(runner: RunnerName, wanted: str) -> str:
    """Why a generate runner does not serve `wanted` (embeddings, scores), and the runner to start."""
    return (
        f"this server runs the {runner} runner, which serves completions and chat; {wanted} need a server "
        "started with --runner pooling (or --task embed)"
    )


class PoolingRules:
    """The engine's admission rules of its runner: which requests it serves, and its pooler config."""

    def __init__(
        self,
        runner: RunnerName,
        pooler: PoolerConfig | None,
        matryoshka: Matryoshka | None,
        score_head: ScoreHead | None = None,  # a sequence-classification model's (pooling runner only)
    ) -> None:
        self.runner = runner
        self.pooler = pooler or PoolerConfig()
        self.matryoshka = matryoshka
        self.score_head = score_head

    @property
    def supported_tasks(self) -> tuple[SupportedTask, ...]:
        """What this engine serves: generate; or a cross-encoder's scores; or embeddings and their cosines."""
        if self.runner == "generate":
            return ("generate",)
        return ("score",) if self.score_head is not None else ("embed", "score")

    def admit(self, params: SamplingParams) -> SamplingParams:
        """`params` with the runner's pooling filled in; RequestRejectedError saying which runner to start when
        the request is not this runner's, or naming `dimensions` when the model declares no such width."""
        pooling = params.pooling
        if self.runner == "generate" and pooling is not None:
            raise RequestRejectedError(
                runner_message("generate", "embeddings" if pooling.task == "embed" else "scores"),
                "input" if pooling.task == "embed" else "model",
            )
        if self.runner == "pooling" and pooling is None:
            served = (
                "/score and /rerank" if self.score_head is not None else "/v1/embeddings, /score and /rerank"
            )
            raise RequestRejectedError(
                f"this server runs the pooling runner (--runner pooling), which serves {served} only; "
                "completions and chat need a server started with --runner generate (the default)",
                "model",
            )
        if pooling is None:
            return params
        if pooling.task == "embed" and self.score_head is not None:
            raise RequestRejectedError(
                "this model is a sequence-classification model (a cross-encoder): it serves /score and /rerank, "
                "not embeddings",
                "input",
            )
        if pooling.task == "score" and self.score_head is None:
            raise RequestRejectedError(
                "a score request runs a sequence-classification model's head, and this model has none (an "
                "embedding model scores by the cosine of two embeddings)",
                "model",
            )
        if pooling.dimensions is not None:
            if self.matryoshka is None:
                raise RequestRejectedError(
                    "dimensions is only supported by models that declare Matryoshka dimensions "
                    "(matryoshka_dimensions in config.json); this one does not",
                    "dimensions",
                )
            self.matryoshka.check(pooling.dimensions)
        return replace(params, pooling=pooling.resolved(self.pooler))
