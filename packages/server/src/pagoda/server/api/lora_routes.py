"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), and the adapters' /v1/models cards.

Served only with `--enable-lora --allow-runtime-lora-updating` (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), behind
the API key like every route but /health, and only for an admin key (`--admin-api-key`; 403 for another key,
checked before the body or any folder is read): what the admin loads, every key may use. A load reads and checks
the folder on a worker thread, then registers it on the engine thread between two steps; with engine-core processes (`--engine-core process`, data-parallel
replicas) every core does so and the call answers once all of them did (`CoreClient.load_lora`). An unload takes
the name away at once, while requests already running on the adapter finish on it. Every bad input is a 400 naming
the field.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Future

from pagoda.server.api.admin import require_admin
from pagoda.server.api.errors import bad_request
from pagoda.server.api.protocol import LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest
from pagoda.server.async_llm import AsyncLLM
from pagoda.server.core import CoreClient
from pagoda.server.engine import LLMEngine
from pagoda.server.engine_client import EngineClient
from pagoda.server.lora.request import LoRAError, LoRARequest
from pagoda.server.lora.served import ServedLoRAs
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

ReadBody = Callable[
    [Request, type[LoadLoRAAdapterRequest] | type[UnloadLoRAAdapterRequest]], Awaitable[object]
]


def lora_cards(
    loras: ServedLoRAs | None, base: str, max_model_len: int, *, show_paths: bool = True
) -> list[ModelCard]:
    """One /v1/models card per served adapter, `parent` naming the base model; `root` is its folder when
    `show_paths` (the admin), else its name (no server path for other keys)."""
    if loras is None:
        return []
    return [
        ModelCard(
            id=name, root=request.lora_path if show_paths else name, parent=base, max_model_len=max_model_len
        )
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

    def _engine(self) -> LLMEngine | CoreClient:
        """The in-process engine or the engine cores (a 400 for another engine client)."""
        engine = self.llm.engine
        if not isinstance(engine, LLMEngine | CoreClient):
            raise bad_request("runtime LoRA updating needs the in-process engine or engine-core processes")
        return engine

    async def _on_cores(self, call: Callable[[CoreClient], Future[tuple[int, ...]]]) -> None:
        """Send a load or unload to every core (on the engine thread) and wait for all of them to answer."""
        future = await self.llm.call_on_engine_thread(lambda e: call(_as_cores(e)))
        await asyncio.wrap_future(future)

    async def load(self, request: Request) -> Response:
        """POST /v1/load_lora_adapter {lora_name, lora_path} (an admin key's: 403 for another)."""
        require_admin(request, "Loading a LoRA adapter")
        body = await self.read_body(request, LoadLoRAAdapterRequest)
        assert isinstance(body, LoadLoRAAdapterRequest)
        name = body.lora_name
        if name == self.served_model_name or self.loras.get(name) is not None:
            raise bad_request(f"the name {name!r} is already taken", "lora_name")
        engine = self._engine()
        lora = self.loras.new_request(name, body.lora_path)
        try:
            if isinstance(engine, CoreClient):
                await self._on_cores(lambda cores: cores.load_lora(lora))
            else:
                adapter = await asyncio.to_thread(
                    engine.load_lora, lora
                )  # the disk read, off the engine thread
                await self.llm.call_on_engine_thread(lambda e: _as_engine(e).add_loaded_lora(adapter))
        except LoRAError as exc:
            raise bad_request(str(exc), exc.param) from exc
        self.loras.add(lora)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        """POST /v1/unload_lora_adapter {lora_name} (an admin key's: 403 for another)."""
        require_admin(request, "Unloading a LoRA adapter")
        body = await self.read_body(request, UnloadLoRAAdapterRequest)
        assert isinstance(body, UnloadLoRAAdapterRequest)
        name = body.lora_name
        if self.loras.get(name) is None:
            raise bad_request(f"no LoRA adapter named {name!r} is loaded", "lora_name")
        engine = self._engine()
        removed: LoRARequest | None = self.loras.remove(name)  # new requests cannot name it from now on
        try:
            if isinstance(engine, CoreClient):
                await self._on_cores(lambda cores: cores.unload_lora(name))
            else:
                await self.llm.call_on_engine_thread(lambda e: _as_engine(e).remove_lora(name))
        except LoRAError as exc:
            if removed is not None:
                self.loras.add(removed)
            raise bad_request(str(exc), exc.param) from exc
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _as_cores(engine: EngineClient) -> CoreClient:
    """The engine thread's engine as the CoreClient the handler checked it is."""
    assert isinstance(engine, CoreClient)
    return engine


def _as_engine(engine: EngineClient) -> LLMEngine:
    """The engine thread's engine as the LLMEngine the handler checked it is."""
    assert isinstance(engine, LLMEngine)
    return engine
