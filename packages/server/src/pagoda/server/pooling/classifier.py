"""The score of a sequence-classification model (a cross-encoder): its head on the pooled row, then its activation.

transformers' `*ForSequenceClassification` runs `score` (hidden_size -> num_labels) over the final hidden states
and keeps the row of the last token that is not `pad_token_id`; what its logit means is the config's:
`problem_type` "regression" is a raw value, otherwise (one label) a logit whose sigmoid is the probability of
"relevant". vLLM's score activation is the same sigmoid, or the one a sentence-transformers cross-encoder's
config names (`sentence_transformers.activation_fn`, `sbert_ce_default_activation_function`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pagoda.server.models.layers import Linear
from pagoda.server.pooling.params import RunnerName
from torch import Tensor

# What turns the head's logit into the score: sigmoid, or the logit itself (a regression head).
ScoreActivation = Literal["sigmoid", "identity"]
# The sentence-transformers activation names a cross-encoder's config may carry (vLLM loads only torch.nn.modules;
# these are the ones that mean something for one label: Softmax over one logit would always be 1).
_NAMED_ACTIVATIONS: dict[str, ScoreActivation] = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
}
CLASSIFIER_ARCHITECTURES = frozenset(
    {"LlamaForSequenceClassification", "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification"}
)


class ClassifierConfigError(ValueError):
    """A sequence-classification model this server cannot score with; `key` names the config key at fault."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


def _activation(config: dict[str, Any]) -> ScoreActivation:
    """The score activation a model's config.json asks for (see the module docstring)."""
    named = (config.get("sentence_transformers") or {}).get("activation_fn")
    key = "sentence_transformers.activation_fn"
    if named is None:
        named, key = (
            config.get("sbert_ce_default_activation_function"),
            "sbert_ce_default_activation_function",
        )
    if named is not None:
        if named not in _NAMED_ACTIVATIONS:
            raise ClassifierConfigError(
                f"config.json {key} {named!r} is not supported (supported: {', '.join(_NAMED_ACTIVATIONS)})",
                key,
            )
        return _NAMED_ACTIVATIONS[named]
    return "identity" if config.get("problem_type") == "regression" else "sigmoid"


def _num_labels(config: dict[str, Any]) -> int:
    """Labels of a config.json as transformers counts them: `id2label`'s entries, else `num_labels`, else 2."""
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return len(id2label)
    return int(config.get("num_labels", 2))


@dataclass(frozen=True, slots=True)
class ScoreHead:
    """A cross-encoder's score of one prompt: `score` on the row of its last non-pad token, then the activation."""

    score: Linear  # the model's head, [num_labels, hidden_size] (the driver rank's, whole)
    activation: ScoreActivation
    pad_token_id: int | None  # transformers pools the last token that is not this one

    @classmethod
    def of_model(cls, model_path: Path, score: Linear) -> ScoreHead:
        """The head of the model in `model_path` (its config.json says the activation and pad id);
        ClassifierConfigError naming `num_labels` unless the model has one label (a relevance logit)."""
        config: dict[str, Any] = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
        labels = _num_labels(config)
        if labels != 1:
            raise ClassifierConfigError(
                f"/score and /rerank need a sequence-classification model of one label (a relevance logit); "
                f"this one has num_labels {labels}",
                "num_labels",
            )
        pad = config.get("pad_token_id")
        return cls(score, _activation(config), pad if isinstance(pad, int) else None)

    def pool_position(self, prompt: Sequence[int]) -> int:
        """The position transformers reads: the last whose token is not the pad id (0 when all are; the last one
        without a pad id)."""
        if self.pad_token_id is None:
            return len(prompt) - 1
        for position in range(len(prompt) - 1, -1, -1):
            if prompt[position] != self.pad_token_id:
                return position
        return 0  # transformers' argmax over an all-zero mask

    @torch.inference_mode()
    def __call__(self, row: Tensor, use_activation: bool) -> Tensor:  # float32 [hidden_size] -> [num_labels]
        """The score of a pooled row (float32; the head runs in the weights' dtype, as the model's layers do)."""
        # The weights' dtype is the activations' (a quantized head keeps it on its placeholder).
        logits: Tensor = self.score(row.to(self.score.weight.dtype).unsqueeze(0))[0].float()
        if use_activation and self.activation == "sigmoid":
            return torch.sigmoid(logits)
        return logits


def check_runner(architectures: Sequence[str], runner: RunnerName) -> None:
    """ClassifierConfigError naming `runner` when a sequence-classification model is not served by the pooling
    runner (it has no LM head to generate with)."""
    found = [arch for arch in architectures if arch in CLASSIFIER_ARCHITECTURES]
    if found and runner != "pooling":
        raise ClassifierConfigError(
            f"{found[0]} is a sequence-classification model (a cross-encoder, no LM head): serve it with "
            f"--runner pooling, which answers /score and /rerank, not --runner {runner}",
            "runner",
        )


def check_model_folder(model: str | None, runner: RunnerName) -> None:
    """`check_runner` on a model folder's config.json, before any weight loads (nothing for other models)."""
    if model is None:
        return
    config_file = Path(model).expanduser() / "config.json"
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text(encoding="utf-8"))
    architectures = config.get("architectures") or []
    check_runner([a for a in architectures if isinstance(a, str)], runner)
