"""`LoRARequest` (vLLM's name and fields): which adapter a request runs under, and where its PEFT folder is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class LoRAError(ValueError):
    """An adapter that cannot be served (bad folder, rank, targets, dtype, name); `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter: its served name, a positive id unique per adapter, and its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None  # the model it was trained on (shown as `parent` by /v1/models)

    def __post_init__(self) -> None:
        """LoRAError naming the field."""
        if not self.lora_name:
            raise LoRAError("lora_name must not be empty", "lora_name")
        if self.lora_int_id < 1:
            raise LoRAError(f"lora_int_id must be >= 1, got {self.lora_int_id}", "lora_int_id")
        if not self.lora_path:
            raise LoRAError("lora_path must not be empty", "lora_path")


class AdapterRun(NamedTuple):
    """A step's chunk as LoRA sees it: its adapter and its number of token rows (what `LoRAManager.prepare` reads
    of a `ScheduledRequest`; attention/FFN disaggregation sends these to the FFN ranks)."""

    lora_id: int | None  # None: the base model
    num_tokens: int
