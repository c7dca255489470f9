"""What the engine returns for each request: cumulative snapshots, vLLM's RequestOutput shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagoda.server.kv_tiers.connector import KVTierStats

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class Logprob:
    """Log-probability of one token at one position, its rank in the distribution and its text."""

    logprob: float
    rank: int
    decoded_token: str


# One position's entry: the sampled token and the top alternatives, keyed by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One of a request's n samples, everything generated so far."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None
    logprobs: tuple[PositionLogprobs, ...] | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Seconds from arrival to finish."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's state after a step: prompt, every sample so far, whether all samples finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # Per prompt position (vLLM's prompt_logprobs): None for the first token, then the prompt token and the top-k.
    prompt_logprobs: tuple[PositionLogprobs | None, ...] | None = None
    # A pooling request's vector (vLLM's PoolingRequestOutput.outputs.data), once finished; None otherwise.
    embedding: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters, for /metrics and logs."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # fraction of device KV blocks in use
    num_kv_blocks: int
    block_size: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache (counter)
    prefix_cache_hits: int  # tokens served by it (counter)
    num_preemptions: int  # counter
    prompt_tokens: int  # prompt tokens computed (counter)
    generation_tokens: int  # tokens generated (counter)
    num_host_blocks: int = 0  # host (swap) tier capacity in blocks
    enable_prefix_caching: bool = False
    # With KV cache groups: the fraction of device blocks each group holds (empty with one group).
    kv_cache_usage_per_group: tuple[float, ...] = ()
    # Speculative decoding counters (vLLM's names): drafted chunks, draft tokens, accepted ones, and accepted
    # drafts by position in the run.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # KV tiers (pagoda.server.kv_tiers), host then disk: this engine's hits and bytes, the tier's occupancy.
    kv_tiers: tuple[KVTierStats, ...] = ()
    # The scheduler's latest step shape (the adaptive profile chooses it per step; else the configured limits).
    token_budget: int = 0
    chunk_size: int = 0
    max_num_seqs: int = 0
    # Finished sequences per priority class (with --slo-* or the adaptive profile): (priority, ttft_met,
    # ttft_total, tpot_met, tpot_total); and steps in which adaptive gave up (ttft, tpot).
    slo_attainment: tuple[tuple[int, int, int, int, int], ...] = ()
    slo_sacrificed: tuple[int, int] = (0, 0)
