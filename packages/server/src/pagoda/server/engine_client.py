"""The narrow interface `AsyncLLM` needs from an engine; `pagoda.server.engine.LLMEngine` satisfies it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagoda.server.outputs import EngineStats, RequestOutput
from pagoda.server.sampling_params import SamplingParams
from transformers import PreTrainedTokenizerBase


class EngineClient(Protocol):
    """A synchronous, single-threaded engine: requests in, cumulative snapshots out of each `step`.

    `add_request` raises a ValueError with a `param` attribute (RequestRejectedError) when the request can
    never run; `abort_request` frees the request's KV blocks at once and ignores unknown ids.
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
    ) -> None:
        """Queue a request."""
        ...

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return a snapshot of every request that progressed or finished."""
        ...

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        ...

    def get_stats(self) -> EngineStats:
        """The engine's gauges and counters now."""
        ...
