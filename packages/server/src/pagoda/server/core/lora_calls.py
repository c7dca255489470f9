"""The front end's side of runtime LoRA updating with engine cores: each load or unload goes to every ready core
and completes once all of them answered; adapters loaded at run time are replayed to a core that (re)starts.

A call's future gives the indices of the replicas that applied it, or raises the first refusal's `LoRAError`
(a load refused by one core is then unloaded from those that took it, so that every core serves the same
adapters). A replica that dies before answering is not waited for: it gets the adapter at its restart.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field

from pagoda.server.core.lora_frames import LoadLoRA, LoRADone, UnloadLoRA
from pagoda.server.lora.request import LoRAError, LoRARequest


@dataclass(slots=True)
class _Call:
    """One broadcast: what it asked, who still owes an answer, who applied it, the first refusal."""

    frame: LoadLoRA | UnloadLoRA
    future: Future[tuple[int, ...]]
    waiting: set[int]
    applied: list[int] = field(default_factory=list)
    error: LoRAError | None = None


class LoRACalls:
    """Calls in flight by id, and the adapters loaded at run time (by name) that a new core must load too."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self.runtime: dict[str, LoRARequest] = {}

    @property
    def pending(self) -> bool:
        """Whether a call still waits for a core's answer (the engine thread must keep reading frames)."""
        return bool(self._calls)

    def load(self, request: LoRARequest, replicas: list[int]) -> tuple[LoadLoRA, Future[tuple[int, ...]]]:
        """A load for the given (ready) replicas: its frame and its future."""
        self.runtime[request.lora_name] = request
        frame = LoadLoRA(next(self._ids), request)
        return frame, self._start(frame, replicas)

    def unload(self, lora_name: str, replicas: list[int]) -> tuple[UnloadLoRA, Future[tuple[int, ...]]]:
        """An unload for the given (ready) replicas: its frame and its future."""
        self.runtime.pop(lora_name, None)
        frame = UnloadLoRA(next(self._ids), lora_name)
        return frame, self._start(frame, replicas)

    def _start(self, frame: LoadLoRA | UnloadLoRA, replicas: list[int]) -> Future[tuple[int, ...]]:
        future: Future[tuple[int, ...]] = Future()
        call = _Call(frame, future, set(replicas))
        self._calls[frame.call_id] = call
        self._settle(frame.call_id, call)
        return future

    def replay(self) -> list[LoadLoRA]:
        """The loads a core that just became ready needs (answers to them are not waited for)."""
        return [LoadLoRA(next(self._ids), request) for request in self.runtime.values()]

    def answer(self, replica: int, done: LoRADone) -> list[tuple[int, UnloadLoRA]]:
        """Record a core's answer; the unloads (by replica) that roll back a refused load (empty otherwise)."""
        call = self._calls.get(done.call_id)
        if call is None or replica not in call.waiting:
            return []  # a replayed load's answer, or a stray one
        call.waiting.discard(replica)
        if done.message is None:
            call.applied.append(replica)
        elif call.error is None:
            call.error = LoRAError(done.message, done.param or "lora_path")
        return self._settle(done.call_id, call)

    def replica_lost(self, replica: int) -> list[tuple[int, UnloadLoRA]]:
        """A replica died: no call waits for it any longer; the unloads that roll back a refused load."""
        rollback: list[tuple[int, UnloadLoRA]] = []
        for call_id, call in list(self._calls.items()):
            if replica in call.waiting:
                call.waiting.discard(replica)
                rollback += self._settle(call_id, call)
        return rollback

    def _settle(self, call_id: int, call: _Call) -> list[tuple[int, UnloadLoRA]]:
        """Complete the call once nobody owes an answer; the unloads that roll a refused load back."""
        if call.waiting:
            return []
        del self._calls[call_id]
        if call.error is None:
            call.future.set_result(tuple(sorted(call.applied)))
            return []
        call.future.set_exception(call.error)
        if isinstance(call.frame, LoadLoRA):
            name = call.frame.request.lora_name
            self.runtime.pop(name, None)
            return [(index, UnloadLoRA(next(self._ids), name)) for index in call.applied]
        return []
