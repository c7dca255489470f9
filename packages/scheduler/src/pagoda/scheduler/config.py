"""Scheduler configuration (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# The one spelling of the mode in the workspace: embedders (the server's config and CLI) import it. "auto"
# chooses per victim by a `PreemptionCostModel` (preemption.py); the other two force one mechanism.
PreemptionMode = Literal["recompute", "swap", "auto"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits and features of the scheduler; the block size is the allocator's (`kv.block_size`)."""

    max_num_seqs: int = 256  # sequences in the running batch
    max_num_batched_tokens: int = 2048  # token budget of one step (sum of chunk lengths)
    max_model_len: int = 2048  # prompt + output tokens of one sequence
    enable_chunked_prefill: bool = True
    # Cap on one request's prefill chunk (chunked prefill only); None: only the budget caps it.
    long_prefill_token_threshold: int | None = None
    # Requests that may be mid-prefill at once (vLLM's max_num_partial_prefills); None: no cap.
    max_num_partial_prefills: int | None = None
    # Prefill tokens (chunks that are not decodes) one step may compute, apart from decodes: TGI's
    # --max-batch-prefill-tokens. None: only max_num_batched_tokens caps them.
    max_batch_prefill_tokens: int | None = None
    enable_prefix_caching: bool = True  # count cached prompt blocks as computed at admission
    preemption_mode: PreemptionMode = "recompute"
    # Fraction of blocks admission (and swap-in) leaves free so running decodes do not preempt at once.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        """ValueError on an impossible configuration."""
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 1:
            raise ValueError(f"limits must be positive: {self}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be None or positive")
        for name in ("max_num_partial_prefills", "max_batch_prefill_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be None or positive, not {value}")
        if self.preemption_mode not in get_args(PreemptionMode):
            modes = " or ".join(map(repr, get_args(PreemptionMode)))
            raise ValueError(f"preemption_mode must be {modes}, not {self.preemption_mode!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), not {self.watermark}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a whole (possibly recomputed) sequence must fit into one step.
            raise ValueError("without chunked prefill max_num_batched_tokens must be >= max_model_len")
        prefill_cap = self.max_batch_prefill_tokens
        if not self.enable_chunked_prefill and prefill_cap is not None and prefill_cap < self.max_model_len:
            raise ValueError("without chunked prefill max_batch_prefill_tokens must be >= max_model_len")
