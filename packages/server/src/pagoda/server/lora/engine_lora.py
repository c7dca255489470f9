"""The engine's side of LoRA: served adapters by name, the gate of requests whose adapter is being read, pins.

A request names its adapter by `LoRARequest`; while the adapter's weights are not loaded (first use, or evicted
beyond max_cpu_loras) the request waits here, unknown to the scheduler, while one background thread reads the
folder: no step waits on a disk. Unloading an adapter (`remove`) takes its name away at once, but its weights
stay until the requests that started on it have finished.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
from pagoda.pagedkernel.lora import LoRABackendName
from pagoda.server.config import EngineConfig
from pagoda.server.engine.host import run_releasing_openmp
from pagoda.server.lora.manager import LoRAManager
from pagoda.server.lora.peft_loader import LoRAAdapter
from pagoda.server.lora.request import LoRAError, LoRARequest
from pagoda.server.models.base import CausalLM

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.01  # how long an idle step waits for a held adapter
DEFAULT_MAX_LORAS = 1  # vLLM's default of --max-loras


@dataclass(frozen=True, slots=True)
class _Held:
    """A request waiting for its adapter: the read, and what hands the request on once it is done."""

    lora_id: int
    adapter: Future[LoRAAdapter]
    forward: Callable[[], None]


class EngineLoRA:
    """Served adapters (by name), their loading off the engine thread and the requests waiting for it."""

    def __init__(self, manager: LoRAManager) -> None:
        self.manager = manager
        self.served: dict[str, LoRARequest] = {}  # by name, in load order
        self._held: dict[str, _Held] = {}  # request id -> its wait
        self._retired: set[int] = set()  # unloaded ids whose weights wait for their last request
        self._lora_of: dict[str, int] = {}  # unfinished request id -> the adapter it runs under (pinned)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-lora-load")

    def __len__(self) -> int:
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

    def admit(self, request_id: str, lora: LoRARequest, forward: Callable[[], None]) -> None:
        """Pin the adapter for this request and hand it on (`forward`) now, or once its weights are read."""
        self.manager.pin(lora.lora_int_id)
        self._lora_of[request_id] = lora.lora_int_id
        if self.manager.has(lora.lora_int_id):
            forward()
            return
        self._held[request_id] = _Held(
            lora.lora_int_id, self._reader.submit(run_releasing_openmp, self.manager.load, lora), forward
        )

    def admit_ready(self) -> list[str]:
        """Hand on every held request whose adapter is read; the ids whose read failed (logged; the engine
        aborts them, which releases their pin)."""
        failed: list[str] = []
        for request_id, held in list(self._held.items()):
            if not held.adapter.done():
                continue
            del self._held[request_id]
            try:
                adapter = held.adapter.result()
                if not self.manager.has(held.lora_id):
                    self.manager.add(adapter)
                held.forward()
            except Exception:  # a folder that changed or vanished since it was checked
                logger.exception("request %s: its LoRA adapter could not be loaded", request_id)
                failed.append(request_id)
        return failed

    def cancel(self, request_id: str) -> None:
        """Stop holding an aborted request (its pin is released by `finish`); an id not held is ignored."""
        held = self._held.pop(request_id, None)
        if held is not None:
            held.adapter.cancel()

    def finish(self, request_id: str) -> None:
        """A request has finished (or was aborted): unpin its adapter, whose weights go with its last request
        once it was unloaded; an id without an adapter is ignored."""
        lora_id = self._lora_of.pop(request_id, None)
        if lora_id is None:
            return
        self.cancel(request_id)
        self.manager.unpin(lora_id)
        if lora_id in self._retired and not self.manager.pins.get(lora_id):
            self._retired.discard(lora_id)
            self.manager.remove(lora_id)

    def wait(self, timeout: float = _POLL_SECONDS) -> bool:
        """Wait up to `timeout` for a held adapter (an idle step's poll); False at once when none is held."""
        if not self._held:
            return False
        wait([held.adapter for held in self._held.values()], timeout=timeout, return_when=FIRST_COMPLETED)
        return True

    def close(self) -> None:
        """Stop the reader thread."""
        self._reader.shutdown(wait=False, cancel_futures=True)


def lora_backend(kernel_backend: str) -> LoRABackendName:
    """The LoRA op's backend for the engine's kernel backend (cpu, torch and triton as named, else auto)."""
    return kernel_backend if kernel_backend in ("torch", "cpu", "triton") else "auto"  # type: ignore[return-value]


def build_manager(
    config: EngineConfig, model: CausalLM, dtype: torch.dtype, device: torch.device
) -> LoRAManager | None:
    """The slot pool and hooks of one rank's model (None without `enable_lora`); tensor-parallel workers build
    theirs from the same config, and read each adapter, cut to their shard, when a step first uses it."""
    lora_config = config.lora_config
    if not lora_config.enable_lora:
        return None
    max_loras = config.scheduler_config.max_loras or DEFAULT_MAX_LORAS
    return LoRAManager(
        model,
        max_loras=max_loras,
        max_lora_rank=lora_config.max_lora_rank,
        max_cpu_loras=lora_config.max_cpu_loras or max_loras,
        dtype=dtype,
        device=device,
        backend=lora_backend(config.model_config.kernel_backend),
    )


def build_engine_lora(
    config: EngineConfig, model: CausalLM, dtype: torch.dtype, device: torch.device
) -> EngineLoRA | None:
    """The engine's LoRA side with `--lora-modules` loaded (None without `enable_lora`); LoRAError if one is bad."""
    manager = build_manager(config, model, dtype, device)
    if manager is None:
        return None
    engine_lora = EngineLoRA(manager)
    for lora_id, module in enumerate(config.lora_config.lora_modules, start=1):
        request = LoRARequest(module.name, lora_id, module.path, module.base_model_name)
        engine_lora.add(manager.load(request))
    return engine_lora
