"""`AttentionFFNConfig`: `--attention-ffn-disaggregation` JSON, parsed and checked once (no torch here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from pagoda.server.config_tree import json_object

FLAG = "--attention-ffn-disaggregation"
_EXAMPLE = '{"attention_workers": 1, "ffn_workers": 1}'


@dataclass(frozen=True, slots=True)
class AttentionFFNConfig:
    """Attention/FFN disaggregation (engine/executor/afd.py): ranks that hold the KV cache and run attention, and
    ranks that hold the MLP weights; activations cross between them every layer, two micro-batches in ping-pong."""

    # Attention ranks (the engine's process first), each 1/A of every layer's heads and of the KV cache
    # (tensor-parallel among themselves); whether the model's heads split A ways is checked at launch.
    attention_workers: int = 1
    ffn_workers: int = 1  # FFN processes, each 1/F of every layer's MLP (tensor-parallel among themselves)

    def __post_init__(self) -> None:
        """ValueError naming the flag and the key: counts are integers >= 1."""
        for key in ("attention_workers", "ffn_workers"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{FLAG} key {key!r} must be an integer >= 1, got {value!r}")


def parse_attention_ffn_config(
    value: str | Mapping[str, object] | AttentionFFNConfig | None,
) -> AttentionFFNConfig | None:
    """The config of the flag's JSON, of a mapping (`LLM(attention_ffn_disaggregation={...})`) or a config as is
    (None or empty text: off); ValueError naming the flag and a bad key."""
    if value is None or isinstance(value, AttentionFFNConfig):
        return value
    if value == "":
        return None
    data = json_object(value, FLAG, example=_EXAMPLE)
    known = {f.name for f in fields(AttentionFFNConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(
            f"{FLAG} has unknown key(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    return AttentionFFNConfig(**data)  # type: ignore[arg-type]  # each key's type is checked by the config
