"""The words of one request's life between an engine client and the coroutine that waits on it.

Both engine clients use these words: `AsyncLLM` (async_llm.py), which drives an engine on its thread and hands
each request's events to the coroutine waiting on it, and `CoreClient` (core/client.py), the engine of
data-parallel engine cores over ZeroMQ that `AsyncLLM` drives like an in-process `LLMEngine`.

- Admission: `AsyncLLM` checks its limits before a request reaches the engine. A refusal raises at once:
  `EngineOverloadedError` (429, retry), `EngineDrainingError` (503, shutting down), `EngineSleepingError` (503,
  retry: sleep mode, without --wake-on-request), `EngineDeadError`, or
  `RequestRejectedError` (pagoda.scheduler: a 400 naming the field at fault, when the request can never fit).
- Acceptance: the engine queued the request. That is `RequestAccepted`, right away from an in-process engine,
  or out of a later `step` from one that `defers_acceptance` (a core answers with its `Accepted` frame).
- Output: a cumulative `RequestOutput`; a finished one is the last.
- Failure: `RequestFailed(request_id, error)` ends a request without a finished output: a rejection (a core's
  `Rejected` frame, or `add_request` raising), a fault in the request's own bookkeeping, or a death (below).
- Abort: `abort_request` frees the request's KV blocks before the next step. A waiting coroutine that leaves
  (`RequestStream.close`) aborts silently; a drain, a shutdown or a stalled reader aborts with a final output
  whose unfinished samples say `finish_reason == "abort"`.
- Death: the engine, or one replica, died and fails its requests. `EngineDeadError` means nothing more is served;
  `ReplicaDeadError` means one core died and the others still serve; `EngineRestartedError` means the engine is
  being rebuilt. A retry may succeed after either of the last two.

A request's events are the `RequestEvent` union, in this order: one `RequestAccepted`, then outputs, then
nothing more after a finished output; or a `RequestFailed` at any point, which is also the end. An engine's
`step` returns them; `AsyncLLM` passes each to the request's `OutputBox` (output_box.py), and the waiting
`RequestStream` turns them into outputs or the failure's error. api.serving_base.to_api_error maps each error to
its HTTP status.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.server.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine died (its loop failed, or no replica is alive): no request can be served any more."""


class ReplicaDeadError(EngineDeadError):
    """The data-parallel replica serving a request died: the request is lost, the other replicas still serve."""


class EngineRestartedError(ReplicaDeadError):
    """The in-process engine's step raised: the request is lost, the engine is rebuilt and a retry is served."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down and admits no new request."""


class EngineOverloadedError(RuntimeError):
    """Too many sequences are waiting; retry later."""


class EngineSleepingError(RuntimeError):
    """The engine is asleep (sleep mode) and the server does not wake it for requests; retry once it woke."""


@dataclass(frozen=True, slots=True)
class RequestAccepted:
    """The engine queued the request."""

    request_id: str


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """The request ended without a finished output; `error` says why (a rejection, a fault, a death)."""

    request_id: str
    error: Exception


RequestEvent = RequestAccepted | RequestOutput | RequestFailed
