"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), and the adapters' /v1/models cards.

Served only with `--enable-lora --allow-runtime-lora-updating` (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), behind
the API key like every route but /health, and with the in-process engine. A load reads and checks the folder on a
worker thread, then registers it on the engine thread between two steps; an unload takes the name away at once,
while requests already running on the adapter finish on it. Every bad input is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from pagoda.server.api.errors import bad_request
from pagoda.server.api.protocol import LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest
from pagoda.server.async_llm import AsyncLLM
from pagoda.server.engine import LLMEngine
from pagoda.server.engine_client import EngineClient
from pagoda.server.lora.request import LoRAError, LoRARequest
from pagoda.server.lora.served import ServedLoRAs
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

ReadBody = Callable[
    [Request, type[LoadLoRAAdapterRequest] | type[UnloadLoRAAdapterRequest]], Awaitable[object]
]


def lora_cards(loras: ServedLoRAs | None, base: str, max_model_len: int) -> list[ModelCard]:
    """One /v1/models card per served adapter, `parent` naming the base model."""
    if loras is None:
        return []
    return [
        ModelCard(id=name, root=request.lora_path, parent=base, max_model_len=max_model_len)
        for name, request in loras.by_name.items()
    ]


class LoRARoutes:
    """The two handlers, bound to one app's engine front and adapter names."""

    def __init__(
        self, llm: AsyncLLM, loras: ServedLoRAs, served_model_name: str, read_body: ReadBody
    ) -> None:
        self.llm = llm
        self.loras = loras
        self.served_model_name = served_model_name
        self.read_body = read_body

    def _engine(self) -> LLMEngine:
        """The in-process engine (a 400 otherwise: engine-core processes load adapters from --lora-modules)."""
        engine = self.llm.engine
        if not isinstance(engine, LLMEngine):
            raise bad_request("runtime LoRA updating needs the in-process engine (--engine-core inproc)")
        return engine

    async def load(self, request: Request) -> Response:
        """POST /v1/load_lora_adapter {lora_name, lora_path}."""
        body = await self.read_body(request, LoadLoRAAdapterRequest)
        assert isinstance(body, LoadLoRAAdapterRequest)
        name = body.lora_name
        if name == self.served_model_name or self.loras.get(name) is not None:
            raise bad_request(f"the name {name!r} is already taken", "lora_name")
        engine = self._engine()
        lora = self.loras.new_request(name, body.lora_path)
        try:
            adapter = await asyncio.to_thread(engine.load_lora, lora)  # the disk read, off the engine thread
            await self.llm.call_on_engine_thread(lambda e: _as_engine(e).add_loaded_lora(adapter))
        except LoRAError as exc:
            raise bad_request(str(exc), exc.param) from exc
        self.loras.add(lora)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        """POST /v1/unload_lora_adapter {lora_name}."""
        body = await self.read_body(request, UnloadLoRAAdapterRequest)
        assert isinstance(body, UnloadLoRAAdapterRequest)
        name = body.lora_name
        if self.loras.get(name) is None:
            raise bad_request(f"no LoRA adapter named {name!r} is loaded", "lora_name")
        self._engine()
        removed: LoRARequest | None = self.loras.remove(name)  # new requests cannot name it from now on
        try:
            await self.llm.call_on_engine_thread(lambda e: _as_engine(e).remove_lora(name))
        except LoRAError as exc:
            if removed is not None:
                self.loras.add(removed)
            raise bad_request(str(exc), exc.param) from exc
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _as_engine(engine: EngineClient) -> LLMEngine:
    """The engine thread's engine as the LLMEngine the handler checked it is."""
    assert isinstance(engine, LLMEngine)
    return engine
