"""The narrow interface `AsyncLLM` needs from an engine (the engine-core client seam).

Two implementations: `pagoda.server.engine.LLMEngine` itself (in-process: the offline `LLM`, tests, the default
server) and `pagoda.server.core.CoreClient` (engine cores in their own processes or Ray actors, one or many
data-parallel replicas, over ZeroMQ).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pagoda.server.client_stream import RequestEvent
from pagoda.server.multimodal import MultiModalInputs
from pagoda.server.outputs import EngineStats

if TYPE_CHECKING:  # transformers takes seconds to import; `pagoda --help` and /metrics need none of it
    from pagoda.server.pooling import SupportedTask
    from pagoda.server.sampling_params import SamplingParams
    from transformers import PreTrainedTokenizerBase


class EngineClient(Protocol):
    """A synchronous, single-threaded engine: requests in, cumulative snapshots out of each `step`.

    `add_request` raises a ValueError with a `param` attribute (RequestRejectedError) when the request can
    never run; `abort_request` frees the request's KV blocks at once and ignores unknown ids. An engine whose
    `defers_acceptance` attribute is true (a remote core) answers each add later with a `RequestAccepted` or a
    `RequestFailed` event out of `step`. Its events and errors are client_stream.py's. The owner calls `close`
    once when done.
    """

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer."""
        ...

    @property
    def model_name(self) -> str:
        """The model's path or default name."""
        ...

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt plus output) one request may reach."""
        ...

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model accepts."""
        ...

    @property
    def num_kv_blocks(self) -> int:
        """KV-cache blocks on the device."""
        ...

    @property
    def supported_tasks(self) -> tuple[SupportedTask, ...]:
        """What the engine serves (vLLM's name): generate; embed and score (cosine); or score (a cross-encoder)."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per KV-cache block."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> None:
        """Queue a request."""
        ...

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks."""
        ...

    def step(self) -> Sequence[RequestEvent]:
        """Run one scheduling step; return a snapshot of every request that progressed or finished (and, from an
        engine that defers acceptance, its acceptances and failures)."""
        ...

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        ...

    def get_stats(self) -> EngineStats:
        """The engine's gauges and counters now."""
        ...

    def check_health(self) -> None:
        """Raise if the engine can serve no more requests; cheap, called every second or so while idle."""
        ...

    def close(self) -> None:
        """Release what the engine holds outside this process: tensor-parallel workers, engine cores."""
        ...


@runtime_checkable
class SupportsSleep(Protocol):
    """An engine with sleep mode (engine/sleep.py): the in-process `LLMEngine` sleeps and wakes at once (None); a
    `CoreClient` sends the call to every core and returns a future that completes once all of them answered."""

    @property
    def enable_sleep_mode(self) -> bool:
        """Whether the engine may sleep."""
        ...

    def sleep(self, level: int) -> Future[Any] | None:
        """Sleep at `level` (1 or 2); the engine has no unfinished request."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> Future[Any] | None:
        """Wake what `tags` name (None: everything)."""
        ...


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """One data-parallel replica as /health and /metrics show it."""

    alive: bool
    stats: EngineStats | None  # its last stats (None before its first Ready)
    restarts: int
    role: str | None = None  # "prefill" or "decode" with disaggregated serving; None: a plain replica


@runtime_checkable
class ReplicaSet(Protocol):
    """An engine made of several replicas behind a router (`CoreClient`)."""

    def replica_status(self) -> list[ReplicaStatus]:
        """Every replica's state, in index order."""
        ...

    def router_counts(self) -> tuple[int, int]:
        """The router's (hits, misses) counters."""
        ...

    def kv_transfer_counts(self) -> tuple[int, int, float] | None:
        """Prefill-to-decode hand-offs: (transfers, KV bytes moved, seconds); None without disaggregation."""
        ...
