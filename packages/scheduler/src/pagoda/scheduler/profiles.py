"""Scheduling profiles: the design document's three hand-tuned scenes as presets, and `adaptive`'s ceilings.

A profile sets four knobs of `SchedulerConfig`: the token budget (`max_num_batched_tokens`), the running batch
(`max_num_seqs`), the prefill chunk (`long_prefill_token_threshold`) and prefix caching. The document's values
assume a GPU's KV pool; `apply_profile` scales them to the pool the engine actually has (`num_blocks` of
`block_size` tokens), so that no preset asks for more than the pool can hold:

- `max_num_seqs` <= num_blocks // 2: a running sequence holds at least two blocks (its prompt's last and its
  next token's), so more seats than that only buy preemptions;
- `max_num_batched_tokens` <= pool_tokens // 4 (and >= 16): one step's prefill never claims more than a quarter
  of the pool, the rest stays for the running sequences' contexts;
- the chunk <= the budget.

| profile | budget | seats | chunk | prefix caching |
| --- | --- | --- | --- | --- |
| throughput | 16384 | 512 | the budget | on |
| latency | 512 | 32 | 256 | on |
| balanced | 8192 | 128 | the budget | on |
| adaptive | ceilings of throughput; each step chooses below them (`adaptive.AdaptivePolicy`) | | | on |
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagoda.scheduler.config import SchedulerConfig, SchedulingProfileName

_MIN_BUDGET = 16


@dataclass(frozen=True, slots=True)
class ProfilePreset:
    """A profile's knobs before scaling (None chunk: only the budget caps a request's prefill)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    long_prefill_token_threshold: int | None
    enable_prefix_caching: bool


PRESETS: dict[SchedulingProfileName, ProfilePreset] = {
    "throughput": ProfilePreset(16384, 512, None, True),
    "latency": ProfilePreset(512, 32, 256, True),
    "balanced": ProfilePreset(8192, 128, None, True),
    "adaptive": ProfilePreset(16384, 512, None, True),
}


def scaled_preset(name: SchedulingProfileName, num_blocks: int, block_size: int) -> ProfilePreset:
    """`name`'s preset scaled to a pool of `num_blocks` blocks of `block_size` tokens (rules above)."""
    preset = PRESETS[name]
    pool_tokens = num_blocks * block_size
    budget = max(_MIN_BUDGET, min(preset.max_num_batched_tokens, pool_tokens // 4))
    seats = max(1, min(preset.max_num_seqs, num_blocks // 2))
    chunk = preset.long_prefill_token_threshold
    return ProfilePreset(
        budget, seats, None if chunk is None else min(chunk, budget), preset.enable_prefix_caching
    )


def apply_profile(config: SchedulerConfig, num_blocks: int, block_size: int) -> SchedulerConfig:
    """`config` with its profile's scaled knobs (unchanged without a profile). Without chunked prefill the budget
    stays at least `max_model_len` (a whole prompt must fit one step)."""
    if config.scheduling_profile is None:
        return config
    preset = scaled_preset(config.scheduling_profile, num_blocks, block_size)
    budget = preset.max_num_batched_tokens
    if not config.enable_chunked_prefill and config.max_model_len is not None:
        budget = max(budget, config.max_model_len)
    return replace(
        config,
        max_num_batched_tokens=budget,
        max_num_seqs=preset.max_num_seqs,
        long_prefill_token_threshold=preset.long_prefill_token_threshold,
        enable_prefix_caching=preset.enable_prefix_caching and config.enable_prefix_caching,
    )
