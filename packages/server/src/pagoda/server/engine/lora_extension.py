"""The engine's side of LoRA, an engine extension: served adapters by name, the gate of requests whose adapter is
being read, pins.

A request names its adapter by `LoRARequest`; while the adapter's weights are not loaded (first use, or evicted
beyond max_cpu_loras) the request is held here, unknown to the scheduler, while one background thread reads the
folder: no step waits on a disk. Unloading an adapter (`remove`) takes its name away at once, but its weights
stay until the requests that started on it have finished. An engine without LoRA refuses adapter requests at
its gate (`NoLoRA`).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pagoda.server.config import EngineConfig
from pagoda.server.engine.admission import RequestRejectedError
from pagoda.server.engine.extension import Extension, Released, wait_for_any
from pagoda.server.engine.host import run_releasing_openmp
from pagoda.server.engine.request_factory import NewRequest
from pagoda.server.lora.manager import LoRAManager
from pagoda.server.lora.peft_loader import LoRAAdapter
from pagoda.server.lora.request import LoRAError, LoRARequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Held:
    """A request waiting for its adapter: the read, and the request to release once it is done."""

    lora_id: int
    adapter: Future[LoRAAdapter]
    new: NewRequest


class NoLoRA(Extension):
    """The gate of an engine that serves no adapter: a request for one is refused."""

    def hold(self, new: NewRequest) -> bool:
        """RequestRejectedError (field `model`) for an adapter request; every other request passes."""
        if new.lora is not None:
            raise RequestRejectedError("LoRA adapters are served with enable_lora (--enable-lora)", "model")
        return False


class EngineLoRA(Extension):
    """Served adapters (by name), their loading off the engine thread and the requests waiting for it."""

    @classmethod
    def build(cls, config: EngineConfig, manager: LoRAManager) -> EngineLoRA:
        """The extension over the driver's slot pool, with `--lora-modules` loaded (LoRAError if one is bad)."""
        engine_lora = cls(manager)
        for lora_id, module in enumerate(config.lora_config.lora_modules, start=1):
            request = LoRARequest(module.name, lora_id, module.path, module.base_model_name)
            engine_lora.add(manager.load(request))
        return engine_lora

    def __init__(self, manager: LoRAManager) -> None:
        self.manager = manager
        self.served: dict[str, LoRARequest] = {}  # by name, in load order
        self._held: dict[str, _Held] = {}  # request id -> its wait
        self._retired: set[int] = set()  # unloaded ids whose weights wait for their last request
        self._lora_of: dict[str, int] = {}  # unfinished request id -> the adapter it runs under (pinned)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-lora-load")

    def num_held(self) -> int:
        """Requests waiting for their adapter (counted as waiting)."""
        return len(self._held)

    def check_new(self, request: LoRARequest) -> None:
        """LoRAError naming the field if `request` cannot be added beside the served adapters."""
        if request.lora_name in self.served:
            raise LoRAError(f"a LoRA adapter named {request.lora_name!r} is already loaded", "lora_name")
        if any(r.lora_int_id == request.lora_int_id for r in self.served.values()):
            raise LoRAError(f"lora_int_id {request.lora_int_id} is already in use", "lora_int_id")

    def add(self, adapter: LoRAAdapter) -> None:
        """Serve a loaded adapter under its name (`LoRAManager.load` reads it, on any thread)."""
        self.check_new(adapter.request)
        self.manager.add(adapter)
        self.served[adapter.request.lora_name] = adapter.request
        self._retired.discard(adapter.request.lora_int_id)

    def remove(self, name: str) -> LoRARequest:
        """Stop serving `name` (LoRAError if unknown); in-flight requests keep its weights until they finish."""
        request = self.served.pop(name, None)
        if request is None:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded", "lora_name")
        lora_id = request.lora_int_id
        if self.manager.pins.get(lora_id):
            self._retired.add(lora_id)
        else:
            self.manager.remove(lora_id)
        return request

    def hold(self, new: NewRequest) -> bool:
        """Pin the request's adapter (if it names one); hold the request while the adapter's weights are read."""
        lora = new.lora
        if lora is None:
            return False
        self.manager.pin(lora.lora_int_id)
        self._lora_of[new.request.request_id] = lora.lora_int_id
        if self.manager.has(lora.lora_int_id):
            return False
        read = self._reader.submit(run_releasing_openmp, self.manager.load, lora)
        self._held[new.request.request_id] = _Held(lora.lora_int_id, read, new)
        return True

    def release(self) -> Released:
        """Every held request whose adapter is read (now served); the ids whose read failed (logged; the engine
        aborts them, which releases their pin)."""
        released = Released()
        for request_id, held in list(self._held.items()):
            if not held.adapter.done():
                continue
            del self._held[request_id]
            try:
                adapter = held.adapter.result()
                if not self.manager.has(held.lora_id):
                    self.manager.add(adapter)
            except Exception:  # a folder that changed or vanished since it was checked
                logger.exception("request %s: its LoRA adapter could not be loaded", request_id)
                released.failed.append(request_id)
            else:
                released.ready.append(held.new)
        return released

    def done(self, request_id: str) -> None:
        """A request has finished (or was aborted): unpin its adapter, whose weights go with its last request
        once it was unloaded; an id without an adapter is ignored."""
        lora_id = self._lora_of.pop(request_id, None)
        if lora_id is None:
            return
        held = self._held.pop(request_id, None)
        if held is not None:  # aborted while its adapter is read
            held.adapter.cancel()
        self.manager.unpin(lora_id)
        if lora_id in self._retired and not self.manager.pins.get(lora_id):
            self._retired.discard(lora_id)
            self.manager.remove(lora_id)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` for a held adapter (an idle step's poll); False at once when none is held."""
        return wait_for_any([held.adapter for held in self._held.values()], timeout)

    def close(self) -> None:
        """Stop the reader thread."""
        self._reader.shutdown(wait=False, cancel_futures=True)
