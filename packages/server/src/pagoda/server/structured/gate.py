"""The admission gate of constrained requests: held while their grammar compiles, handed over once it is ready.

No step waits on a compilation, and the scheduler never sees a request it cannot run yet: a held request is
unknown to it (aborting it there is a no-op), and the engine counts the held ones as waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import xgrammar as xgr
from pagoda.scheduler import Request, Scheduler

logger = logging.getLogger(__name__)

# How long an idle engine step waits for a held grammar before returning to the caller's command loop.
_POLL_SECONDS = 0.01


@dataclass(frozen=True, slots=True)
class _Held:
    """One request at the gate: what the scheduler gets, the compilation, and who takes the compiled grammar."""

    request: Request
    grammar: Future[xgr.CompiledGrammar]
    start: Callable[[xgr.CompiledGrammar], None]  # gives the request's samples their matchers


class GrammarGate:
    """Holds constrained requests until their grammar is compiled; `admit_ready` hands them to the scheduler."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}  # by request id, in arrival order

    def __len__(self) -> int:
        """Requests held (the engine's stats count them as waiting)."""
        return len(self._held)

    def hold(
        self,
        request: Request,
        grammar: Future[xgr.CompiledGrammar],
        start: Callable[[xgr.CompiledGrammar], None],
    ) -> None:
        """Hold `request` until `grammar` completes; then `start(compiled)` and the scheduler gets it."""
        self._held[request.request_id] = _Held(request, grammar, start)

    def admit_ready(self, scheduler: Scheduler) -> list[str]:
        """Admit every held request whose grammar is ready; the ids of those that failed (logged, no longer held)."""
        failed: list[str] = []
        for request_id, held in list(self._held.items()):
            if not held.grammar.done():
                continue
            del self._held[request_id]
            try:
                held.start(held.grammar.result())
                scheduler.add_request(held.request)
            except (
                Exception
            ):  # the constraint was checked when the request came: this is the engine's failure
                logger.exception("request %s: its grammar could not be compiled or admitted", request_id)
                failed.append(request_id)
        return failed

    def cancel(self, request_id: str) -> None:
        """Stop holding `request_id` (an abort), cancelling its compilation; an id not held is ignored."""
        held = self._held.pop(request_id, None)
        if held is not None:
            held.grammar.cancel()

    def wait(self, timeout: float = _POLL_SECONDS) -> bool:
        """Wait up to `timeout` seconds for a held grammar to complete (an idle step's poll, instead of a spin);
        False at once when none is held."""
        if not self._held:
            return False
        wait([held.grammar for held in self._held.values()], timeout=timeout, return_when=FIRST_COMPLETED)
        return True
