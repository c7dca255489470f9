"""A core's side of runtime LoRA updating: `LoadLoRA` reads the folder on a worker thread (no step waits on a
disk) and registers the adapter once read, between two steps; `UnloadLoRA` applies once the calls before it did
(an unload right after a load finds the adapter). Each is answered with `LoRADone`."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from pagoda.server.core.lora_frames import LoadLoRA, LoRADone, UnloadLoRA
from pagoda.server.engine import LLMEngine
from pagoda.server.engine.host import run_releasing_openmp
from pagoda.server.lora.peft_loader import LoRAAdapter
from pagoda.server.lora.request import LoRAError

logger = logging.getLogger(__name__)


def _failure(call_id: int, exc: BaseException) -> LoRADone:
    """The answer of a call that raised: a LoRAError's text and field; anything else (a bug: the loader raises
    LoRAError only) one fixed text, its detail in this core's log only."""
    if isinstance(exc, LoRAError):
        return LoRADone(call_id, str(exc), exc.param)
    return LoRADone(call_id, "the LoRA adapter could not be loaded (see the server log)", "lora_path")


class CoreLoRA:
    """The core's LoRA calls, applied in the order they came (an unload waits for an earlier load's read)."""

    def __init__(self, engine: LLMEngine, send: Callable[[LoRADone], None]) -> None:
        self.engine = engine
        self._send = send
        # Calls not applied yet, oldest first: a load with its folder read, or an unload.
        self._queue: deque[tuple[int, Future[LoRAAdapter] | str]] = deque()
        self._reader: ThreadPoolExecutor | None = None  # started at the first load

    def handle(self, message: object) -> bool:
        """Queue a LoRA frame, starting a load's read at once (False: `message` is not one)."""
        if isinstance(message, LoadLoRA):
            if self._reader is None:
                self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-core-lora")
            self._queue.append(
                (
                    message.call_id,
                    self._reader.submit(run_releasing_openmp, self.engine.load_lora, message.request),
                )
            )
        elif isinstance(message, UnloadLoRA):
            self._queue.append((message.call_id, message.lora_name))
        else:
            return False
        self.poll()
        return True

    def poll(self) -> None:
        """Apply the calls that can be, in order (between two steps), answering each."""
        while self._queue:
            call_id, call = self._queue[0]
            if isinstance(call, Future) and not call.done():
                return
            self._queue.popleft()
            try:
                if isinstance(call, Future):
                    self.engine.add_loaded_lora(call.result())
                else:
                    self.engine.remove_lora(call)
            except Exception as exc:  # a LoRAError names its field; another failure is the folder's
                logger.info("LoRA call %d refused: %s", call_id, exc, exc_info=not isinstance(exc, LoRAError))
                self._send(_failure(call_id, exc))
            else:
                self._send(LoRADone(call_id))

    def close(self) -> None:
        """Stop the reader thread."""
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
