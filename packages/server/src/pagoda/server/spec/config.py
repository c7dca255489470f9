"""`SpeculativeConfig`: vLLM's `--speculative-config` JSON, parsed and checked once (no torch here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from pagoda.server.config_tree import json_object

# ngram: prompt lookup over the request's own prompt and output; suffix: suffix decoding over it and the recent
# sequences of other requests (both model-free drafts); auto: both, each sequence taking the longer draft, drafts
# only where the measured step costs and acceptance say they pay (spec/auto.py); draft_model: a smaller model of
# the same vocabulary.
SpeculativeMethod = Literal["ngram", "suffix", "auto", "draft_model"]
_DEFAULT_LOOKUP_MIN, _DEFAULT_LOOKUP_MAX = 2, 5
# k when the config does not give one: auto's policy picks 0..k per sequence and step, and on the default model
# one stream drafting up to 8 ran 1.36-1.49x plain greedy against 1.18-1.30x with up to 4 (packages/server
# README, "Drafts that switch themselves on"); the fixed methods draft k every step, vLLM's usual 4.
_DEFAULT_DRAFTS = 4
_DEFAULT_AUTO_DRAFTS = 8
_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "draft_tensor_parallel_size",
)
# Methods vLLM has that this engine does not run yet: named in the error, so the message says which exist.
_NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How the engine drafts: the method, k drafts per step, and the n-gram sizes prompt lookup matches."""

    method: SpeculativeMethod = "ngram"
    # k: drafted tokens per decode step (auto: at most); None: the method's default (`k`)
    num_speculative_tokens: int | None = None
    # ngram: the longest and shortest suffix of the sequence looked up in its earlier tokens (longest first).
    prompt_lookup_max: int = _DEFAULT_LOOKUP_MAX
    prompt_lookup_min: int = _DEFAULT_LOOKUP_MIN
    model: str | None = None  # draft_model only: the draft's HF folder or .gguf file (same vocabulary)
    draft_tensor_parallel_size: int = 1  # draft_model only: the draft runs unsplit on the driver (1 only)

    @property
    def k(self) -> int:
        """Drafted tokens per decode step (auto: the most): the config's, else 8 for auto and 4 for the others."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return _DEFAULT_AUTO_DRAFTS if self.method == "auto" else _DEFAULT_DRAFTS

    def __post_init__(self) -> None:
        """ValueError naming the key."""
        if self.method not in get_args(SpeculativeMethod):
            later = f" ({self.method!r} is not available yet)" if self.method in _NOT_YET else ""
            raise ValueError(
                f"speculative_config key 'method' must be one of {get_args(SpeculativeMethod)}, "
                f"not {self.method!r}{later}"
            )
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, key)
            if value is None and key == "num_speculative_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config key {key!r} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                "speculative_config key 'prompt_lookup_min' must be <= 'prompt_lookup_max', got "
                f"{self.prompt_lookup_min} > {self.prompt_lookup_max}"
            )
        if self.method == "draft_model":
            _check_draft_path(self.model)
        elif self.model is not None:
            raise ValueError(
                f"speculative_config key 'model' is for method 'draft_model', not {self.method!r}"
            )
        tp = self.draft_tensor_parallel_size
        if isinstance(tp, bool) or tp != 1:
            raise ValueError(
                f"speculative_config key 'draft_tensor_parallel_size' must be 1 (the draft runs unsplit), got {tp!r}"
            )


def _check_draft_path(model: object) -> None:
    """ValueError naming 'model' unless it is a model folder (config.json) or a .gguf file (the loader's rule)."""
    if not isinstance(model, str) or not model:
        raise ValueError(
            "speculative_config key 'model' (the draft model's path) is required for 'draft_model'"
        )
    path = Path(model).expanduser()
    if not (path.is_dir() and (path / "config.json").is_file()) and not (
        path.is_file() and path.suffix == ".gguf"
    ):
        raise ValueError(
            f"speculative_config key 'model': {model!r} is neither a model folder (config.json + safetensors) "
            "nor a .gguf file"
        )


def parse_speculative_config(value: str | Mapping[str, object] | SpeculativeConfig) -> SpeculativeConfig:
    """The config of a JSON object (the flag), a mapping (`LLM(speculative_config={...})`) or a config as is;
    ValueError naming the key (or saying the JSON is invalid)."""
    if isinstance(value, SpeculativeConfig):
        return value
    fields = json_object(value, "speculative_config", example='{"method": "ngram"}')
    unknown = sorted(set(map(str, fields)) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: {list(_KEYS)}")
    if "method" not in fields:
        raise ValueError("speculative_config key 'method' is required (e.g. \"ngram\")")
    # One of the two n-gram sizes alone keeps the other's default unless that would contradict it.
    longest, shortest = fields.get("prompt_lookup_max"), fields.get("prompt_lookup_min")
    if isinstance(longest, int) and shortest is None:
        fields["prompt_lookup_min"] = min(_DEFAULT_LOOKUP_MIN, longest)
    if isinstance(shortest, int) and longest is None:
        fields["prompt_lookup_max"] = max(_DEFAULT_LOOKUP_MAX, shortest)
    try:
        return SpeculativeConfig(**fields)  # type: ignore[arg-type]
    except TypeError as exc:
        raise ValueError(f"speculative_config: {exc}") from None
