"""The frames of runtime LoRA updating with engine-core processes (`POST /v1/load_lora_adapter` / `unload`).

Front end -> every core: `LoadLoRA` (the core reads and checks the folder off its step loop, then registers the
adapter between two steps) and `UnloadLoRA` (its requests already running on the adapter finish on it). Each
core answers `LoRADone` with the call's id: no error, or the `LoRAError`'s message and field.
"""

from __future__ import annotations

import msgspec
from pagoda.server.lora.request import LoRARequest


class LoadLoRA(msgspec.Struct, frozen=True, tag=True):
    """Read, check and serve an adapter (the front end chose its name and id)."""

    call_id: int
    request: LoRARequest


class UnloadLoRA(msgspec.Struct, frozen=True, tag=True):
    """Stop serving an adapter by name."""

    call_id: int
    lora_name: str


class LoRADone(msgspec.Struct, frozen=True, tag=True):
    """A core's answer to `LoadLoRA` / `UnloadLoRA`: `message` and `param` are None when it succeeded."""

    call_id: int
    message: str | None = None
    param: str | None = None
