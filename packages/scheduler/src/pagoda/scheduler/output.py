"""Plain frozen records the scheduler hands to the model runner and to the engine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple


class ScheduledRequest(NamedTuple):
    """One request's chunk in a step: which tokens to compute, where their KV goes, what to sample.

    A NamedTuple (immutable like the frozen dataclasses here) because one is built per request per step and
    a NamedTuple is built several times faster.
    """

    request_id: str
    token_ids: tuple[int, ...]  # input ids of the chunk
    start: int  # position of the first chunk token (= num_computed_tokens before the step)
    num_tokens: int  # chunk length
    block_table: tuple[int, ...]  # device block ids of the whole sequence after this step's allocation
    slots: tuple[int, ...]  # KV slot of each chunk token: block_id * block_size + offset
    num_samples: int  # tokens to sample from the logits at the chunk's last position (0: mid-prompt chunk)
    sample_ids: tuple[str, ...]  # request id each sample goes to (parent first, then forked children)
    # With several KV cache groups: each group's block table and chunk slots (group 0's are the two above).
    group_block_tables: tuple[tuple[int, ...], ...] = ()
    group_slots: tuple[tuple[int, ...], ...] = ()
    lora_id: int | None = None  # the request's LoRA adapter (None: the base model)
    # Draft tokens (speculative decoding): the last len(spec_token_ids) of `token_ids`, whose logits the
    # runner computes too (1 + k rows for the chunk); () for every other chunk.
    spec_token_ids: tuple[int, ...] = ()

    @property
    def seq_len(self) -> int:
        """Context length after the step (what attention reads for the last chunk token)."""
        return self.start + self.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything one step needs. The runner performs, in order: swap out, swap in, copies, forward pass."""

    scheduled: tuple[ScheduledRequest, ...]  # decodes first, then continuing prefills, then admissions
    blocks_to_swap_out: tuple[tuple[int, int], ...]  # (device_block, host_block)
    blocks_to_swap_in: tuple[tuple[int, int], ...]  # (host_block, device_block)
    blocks_to_copy: tuple[tuple[int, int], ...]  # copy-on-write (src_block, dst_block)
    preempted_request_ids: tuple[str, ...]  # preempted in this step (runner drops their per-request state)
    finished_request_ids: tuple[str, ...]  # finished or aborted since the previous step
    num_batched_tokens: int  # sum of chunk lengths (<= max_num_batched_tokens), draft tokens included
    # Request id -> its scheduled draft tokens (vLLM's name), for the chunks that carry any.
    scheduled_spec_decode_tokens: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        """Whether the step has nothing for the runner: no chunk, no swap, no copy."""
        return not (
            self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy
        )


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Counters for logs and metrics."""

    num_running: int  # sequences in the running batch
    num_waiting: int
    num_swapped: int
    num_preemptions: int  # since the scheduler was made
    kv_usage: float  # used / total device blocks
    num_free_blocks: int
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    kv_usage_per_group: tuple[
        float, ...
    ] = ()  # used / total device blocks held by each KV cache group (>1 group)
    # The latest step's shape: its token budget, prefill chunk cap and seats (the config's without a planner).
    token_budget: int = 0
    chunk_size: int = 0
    seats: int = 0
    # Finished sequences per priority class: (priority, ttft_met, ttft_total, tpot_met, tpot_total).
    slo_attainment: tuple[tuple[int, int, int, int, int], ...] = ()
    # Steps in which `adaptive` could not keep both objectives: (TTFT given up, TPOT given up).
    slo_sacrificed: tuple[int, int] = (0, 0)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits over queries, 0.0 before any query."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
