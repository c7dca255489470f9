"""The admission gate of constrained requests, an engine extension: held while their grammar compiles, released
once it is ready.

No step waits on a compilation, and the scheduler never sees a request it cannot run yet: a held request is
unknown to it, and the engine counts the held ones as waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagoda.server.engine.extension import Extension, Released, wait_for_any
from pagoda.server.engine.request_factory import NewRequest
from pagoda.server.structured import StructuredOutputManager

if TYPE_CHECKING:  # xgrammar takes ~0.4 s to import: loaded at the first constrained request, not at start
    import xgrammar as xgr

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Held:
    """One request at the gate: the request, its compilation, and who takes the compiled grammar."""

    new: NewRequest
    grammar: Future[xgr.CompiledGrammar]
    start: Callable[[xgr.CompiledGrammar], None]  # gives the request's samples their matchers


class GrammarGate(Extension):
    """Holds constrained requests until their grammar is compiled (by `structured`, off the engine thread)."""

    def __init__(self, structured: StructuredOutputManager) -> None:
        self.structured = structured
        self._held: dict[str, _Held] = {}  # by request id, in arrival order

    def __len__(self) -> int:
        """Requests held (the engine's stats count them as waiting)."""
        return len(self._held)

    def num_held(self) -> int:
        """Requests held."""
        return len(self._held)

    def hold(self, new: NewRequest) -> bool:
        """Start compiling a constrained request's grammar and hold the request; others pass."""
        if new.grammar is None:
            return False
        constraint, start = new.grammar
        self._held[new.request.request_id] = _Held(new, self.structured.compile(constraint), start)
        return True

    def release(self) -> Released:
        """Every held request whose grammar is ready, its samples given their matchers; the ids whose compilation
        failed (logged, no longer held)."""
        released = Released()
        for request_id, held in list(self._held.items()):
            if not held.grammar.done():
                continue
            del self._held[request_id]
            # The constraint was checked when the request came: a failure here is the engine's.
            try:
                held.start(held.grammar.result())
            except Exception:
                logger.exception("request %s: its grammar could not be compiled or admitted", request_id)
                released.failed.append(request_id)
            else:
                released.ready.append(held.new)
        return released

    def done(self, request_id: str) -> None:
        """Stop holding `request_id` (an abort), cancelling its compilation; an id not held is ignored."""
        held = self._held.pop(request_id, None)
        if held is not None:
            held.grammar.cancel()

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a held grammar to complete (an idle step's poll, instead of a spin);
        False at once when none is held."""
        return wait_for_any([held.grammar for held in self._held.values()], timeout)
