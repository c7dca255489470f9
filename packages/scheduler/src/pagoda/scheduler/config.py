"""Scheduler configuration (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pagoda.scheduler.slo import SLOTargets, parse_slo_targets, target_for

# The one spelling of the mode in the workspace: embedders (the server's config and CLI) import it. "auto"
# chooses per victim by a `PreemptionCostModel` (preemption.py); the other two force one mechanism.
PreemptionMode = Literal["recompute", "swap", "auto"]
# fcfs: arrival order; priority: lower `priority` first; static: traditional batching, a batch forms and runs
# to completion before the next is admitted (policy.py).
SchedulingPolicyName = Literal["fcfs", "priority", "static"]
# The design document's hand-tuned scenes as presets scaled to the KV pool, or `adaptive`, which chooses each
# step's shape from a cost model and the SLOs (profiles.py, adaptive.py); None: the knobs as set.
SchedulingProfileName = Literal["throughput", "latency", "balanced", "adaptive"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits and features of the scheduler; the block size is the allocator's (`kv.block_size`).

    `max_model_len` and `max_num_batched_tokens` may be None in an embedder's configuration ("derive it"):
    the embedder fills them with `dataclasses.replace` once it knows the model, before building a `Scheduler`
    (which refuses None).
    """

    max_num_seqs: int = 256  # sequences in the running batch
    max_num_batched_tokens: int | None = 2048  # token budget of one step (sum of chunk lengths)
    max_model_len: int | None = 2048  # prompt + output tokens of one sequence
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
    # The policy `Scheduler` builds when it is given none (`policy.build_policy`).
    scheduling_policy: SchedulingPolicyName = "fcfs"
    # static: how long the oldest waiting request waits for a batch of max_num_seqs before a smaller one runs.
    static_batch_timeout_s: float = 0.0
    # Distinct LoRA adapters the running batch may use at once (vLLM's --max-loras); None: no cap.
    max_loras: int | None = None
    # Encoder output rows (image tokens) that the running requests' unprefilled images may hold at once (the
    # encoder cache's budget, `EncoderBudget`); None: no cap.
    encoder_cache_tokens: int | None = None
    # A profile's presets replace the budget, seats, chunk and prefix caching once the KV pool is known
    # (`profiles.apply_profile`); "adaptive" also makes `build_policy` return an `AdaptivePolicy`.
    scheduling_profile: SchedulingProfileName | None = None
    # Objectives (ms) per priority class, `((priority or None, ms), ...)` (`slo.parse_slo_targets` reads
    # "500" or "2000,0:300" too): what `adaptive` schedules for and counts attainment of. Empty: none.
    slo_ttft_ms: SLOTargets = ()
    slo_tpot_ms: SLOTargets = ()

    def __post_init__(self) -> None:
        """ValueError naming the field on an impossible configuration."""
        for name in ("slo_ttft_ms", "slo_tpot_ms"):  # a flag's text or a number, stored canonical
            object.__setattr__(self, name, parse_slo_targets(getattr(self, name), name))
        if self.scheduling_profile is not None and self.scheduling_profile not in get_args(
            SchedulingProfileName
        ):
            profiles = " or ".join(map(repr, get_args(SchedulingProfileName)))
            raise ValueError(f"scheduling_profile must be {profiles}, not {self.scheduling_profile!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        for name in (
            "max_num_batched_tokens",
            "max_model_len",
            "long_prefill_token_threshold",
            "max_num_partial_prefills",
            "max_batch_prefill_tokens",
            "max_loras",
            "encoder_cache_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be None or >= 1, got {value}")
        if self.preemption_mode not in get_args(PreemptionMode):
            modes = " or ".join(map(repr, get_args(PreemptionMode)))
            raise ValueError(f"preemption_mode must be {modes}, not {self.preemption_mode!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), not {self.watermark}")
        if self.scheduling_policy not in get_args(SchedulingPolicyName):
            raise ValueError(f"scheduling_policy must be one of {get_args(SchedulingPolicyName)}")
        if self.static_batch_timeout_s < 0:
            raise ValueError(f"static_batch_timeout_s must be >= 0, got {self.static_batch_timeout_s}")
        max_len = self.max_model_len
        if max_len is None or self.enable_chunked_prefill:
            return  # the rules below compare with max_model_len, once it is known
        # Without chunking a whole (possibly recomputed) sequence must fit into one step.
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < max_len:
            raise ValueError("without chunked prefill max_num_batched_tokens must be >= max_model_len")
        if self.max_batch_prefill_tokens is not None and self.max_batch_prefill_tokens < max_len:
            raise ValueError("without chunked prefill max_batch_prefill_tokens must be >= max_model_len")

    def slo_ms(self, name: str, priority: int) -> float | None:
        """The TTFT ("ttft") or TPOT ("tpot") target of a priority class in ms; None without one."""
        return target_for(self.slo_ttft_ms if name == "ttft" else self.slo_tpot_ms, priority)
