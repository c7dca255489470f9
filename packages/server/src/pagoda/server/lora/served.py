"""The API's names of the served adapters: what `model` may name, what /v1/models lists (no torch here).

Ids follow `EngineLoRA.build`'s numbering of `--lora-modules` (1, 2, ...); adapters loaded at run time take the
next ids, never reused, so a prefix-cache block or an engine slot of an unloaded adapter never serves a new one.
"""

from __future__ import annotations

from pagoda.server.config import LoRAConfig
from pagoda.server.lora.request import LoRARequest


class ServedLoRAs:
    """Adapter name -> LoRARequest, as the API resolves a request's `model`."""

    def __init__(self, config: LoRAConfig) -> None:
        self.enabled = config.enable_lora
        self.allow_runtime_updating = config.enable_lora and config.allow_runtime_lora_updating
        self.by_name: dict[str, LoRARequest] = {
            m.name: LoRARequest(m.name, i, m.path, m.base_model_name)
            for i, m in enumerate(config.lora_modules, start=1)
        }
        self._next_id = len(config.lora_modules) + 1

    def get(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, if it names one."""
        return None if name is None else self.by_name.get(name)

    def new_request(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest with the next unused id (not yet served)."""
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return request

    def add(self, request: LoRARequest) -> None:
        """Serve `request` under its name."""
        self.by_name[request.lora_name] = request

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving `name`; its request, or None when it was not served."""
        return self.by_name.pop(name, None)
