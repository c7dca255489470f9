"""The engine's extension seam: where a per-engine feature plugs into the step loop.

A per-request feature is a request type (`pagoda.server.request_contract`); a per-engine feature (adapters,
drafts, grammars, encoders, KV tiers, scheduling inputs) is an `EngineExtension` in the engine's list. `step()`
calls every extension at the same points and names none of them:

1. **Admission, a gate** (`hold` / `release`): a new request passes the extensions in order; one may hold it
   (a grammar compiling, an adapter being read, an image being encoded, KV being fetched from a slower tier) and
   release it at the start of a later step, when it goes on to the next extension and finally the scheduler. A
   held request is unknown to the scheduler and counts as waiting (`num_held`); an idle engine polls the holds
   (`wait`) instead of spinning. `hold` may refuse a request (RequestRejectedError naming the field).
2. **Before execution** (`before_execute`): the scheduled step is known and the model has not run: start what
   the runner needs this step (encoder outputs for the image chunks, KV loads from a tier, a mask fill).
3. **After the update** (`after_update`): every token is in and the scheduler has updated: bookkeeping and
   work for the next step (batched drafts, metrics, feeding a policy's cost model with the step's timing).
4. **A request's end** (`done`): finished or aborted, the extension drops what it kept for it (pins, holds).

What changes the schedule itself is not an extension: scheduling and admission policies (`max_loras`, an
adaptive budget) are the scheduler's policy objects, and a KV connector's scheduler side (tokens a tier can
supply) sits behind the scheduler's allocator Protocol. Model-side work that every tensor-parallel rank must do
(LoRA slots) is a `RunnerHook` of the model runner.
"""

from __future__ import annotations

from collections.abc import Collection
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagoda.scheduler import Scheduler, SchedulerOutput
from pagoda.server.engine.request_factory import NewRequest
from pagoda.server.engine.step_sampler import SampledStep


@dataclass(frozen=True, slots=True)
class Released:
    """What a gate lets go at the start of a step: requests ready to go on, ids whose wait failed (logged; the
    engine aborts them)."""

    ready: list[NewRequest] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class EngineExtension(Protocol):
    """A per-engine feature: a gate at admission, work before execution and after the update, a request's end."""

    def hold(self, new: NewRequest) -> bool:
        """Take a new request in: True holds it until `release` lets it go; False passes it on now."""
        ...

    def release(self) -> Released:
        """At the start of a step: the held requests now ready, and those whose wait failed (no longer held)."""
        ...

    def num_held(self) -> int:
        """Requests held (counted as waiting)."""
        ...

    def wait(self, timeout: float) -> bool:
        """An idle step's poll: wait up to `timeout` s for a hold to end; False at once when none is held."""
        ...

    def before_execute(self, scheduled: SchedulerOutput) -> None:
        """The step is scheduled and the model has not run yet."""
        ...

    def after_update(self, scheduler: Scheduler, sampled: SampledStep, now: float) -> None:
        """The step's tokens are in and the scheduler has updated."""
        ...

    def done(self, request_id: str) -> None:
        """A request finished or was aborted (held or not; an id the extension never saw is ignored)."""
        ...

    def close(self) -> None:
        """The engine closes: stop any thread of its own."""
        ...


class Extension:
    """A base for extensions: every hook does nothing, so that an extension defines only the hooks it uses."""

    def hold(self, new: NewRequest) -> bool:
        """Passes every request on."""
        return False

    def release(self) -> Released:
        """Holds nothing, so releases nothing."""
        return Released()

    def num_held(self) -> int:
        """Holds nothing."""
        return 0

    def wait(self, timeout: float) -> bool:
        """Nothing to wait for."""
        return False

    def before_execute(self, scheduled: SchedulerOutput) -> None:
        """Nothing to start."""

    def after_update(self, scheduler: Scheduler, sampled: SampledStep, now: float) -> None:
        """Nothing to do."""

    def done(self, request_id: str) -> None:
        """Keeps nothing per request."""

    def close(self) -> None:
        """No thread to stop."""


def wait_for_any(futures: Collection[Future[Any]], timeout: float) -> bool:
    """A gate's `wait`: block up to `timeout` s until one of its holds' futures completes; False at once (no
    wait) when it holds none."""
    if not futures:
        return False
    wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
    return True
