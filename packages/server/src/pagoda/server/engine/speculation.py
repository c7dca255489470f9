"""The engine's side of speculative decoding: whether its requests draft, what wraps them, and the engine
extension that counts the verified drafts and runs the draft model's batch after each step."""

from __future__ import annotations

import logging
from collections.abc import Callable

from pagoda.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from pagoda.server.config import EngineConfig
from pagoda.server.engine.counters import TokenCounters
from pagoda.server.engine.draft_setup import LoadedDraft
from pagoda.server.engine.executor.base import Executor
from pagoda.server.engine.extension import Extension
from pagoda.server.engine.preemption_costs import _best_seconds
from pagoda.server.engine.requests import RequestState
from pagoda.server.engine.step_sampler import SampledStep
from pagoda.server.request_contract import SamplesTokens
from pagoda.server.spec.build import build_speculation
from pagoda.server.spec.draft_model import DraftModel
from pagoda.server.spec.policy import DecodeCost, DraftPolicy, StepCostModel

logger = logging.getLogger("pagoda.engine")

# The probe batches: decode steps of these many sequences (up to max_num_seqs), each reading this much context,
# plain and with this many drafts per sequence (~2.5 s at start on the default model: only with drafts on).
_PROBE_BATCHES = (1, 2, 4, 8, 16, 32)
_PROBE_CONTEXT = 256
_PROBE_DRAFTS = 4


def _decode_probe(
    batch_size: int, drafts: int, block_size: int, num_blocks: int, max_model_len: int
) -> SchedulerOutput:
    """A decode step of `batch_size` sequences of `_PROBE_CONTEXT` tokens (fewer where the pool or
    `max_model_len` hold fewer), each with `drafts` drafts (every token with its logits row). They share the
    pool's first blocks: before any request, what they read and write is garbage of the right shape."""
    length = min(_PROBE_CONTEXT + drafts, max_model_len, num_blocks * block_size)
    blocks = tuple(range(-(-length // block_size)))
    start = max(0, length - 1 - drafts)
    chunks = tuple(
        ScheduledRequest(
            request_id=f"draft-probe-{i}",
            token_ids=(0,) * (1 + drafts),
            start=start,
            num_tokens=1 + drafts,
            block_table=blocks,
            slots=tuple(range(start, start + 1 + drafts)),
            num_samples=1,
            sample_ids=(f"draft-probe-{i}",),
            spec_token_ids=(0,) * drafts,
        )
        for i in range(batch_size)
    )
    return SchedulerOutput(chunks, (), (), (), (), (), batch_size * (1 + drafts))


def measure_step_costs(
    executor: Executor, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int = 64
) -> StepCostModel:
    """Time decode steps of 1 to 32 sequences, plain and with drafts, on the engine's model (before any request:
    the blocks they write hold nothing), as the back-off policy's cost model."""
    block_size = executor.driver.kv_cache.shape.block_size
    device = executor.driver.device
    drafts = max(1, min(_PROBE_DRAFTS, max_model_len - 2, executor.num_blocks * block_size - 2))
    batches = [b for b in _PROBE_BATCHES if b <= max_num_seqs and b * (1 + drafts) <= max_num_batched_tokens]
    batches = batches or [1]

    def probe(batch_size: int, num_drafts: int) -> SchedulerOutput:
        return _decode_probe(batch_size, num_drafts, block_size, executor.num_blocks, max_model_len)

    def seconds(step: SchedulerOutput, rounds: int) -> float:
        return _best_seconds(lambda: executor.execute(step, {}), device, rounds)

    executor.execute(probe(batches[-1], drafts), {})  # warm-up
    decodes = tuple(
        DecodeCost(b, seconds(probe(b, 0), 3 if b == 1 else 2), drafts, seconds(probe(b, drafts), 2))
        for b in batches
    )
    largest = decodes[-1]
    per_token = largest.drafted_s / (largest.batch_size * (1 + drafts))
    return StepCostModel(one_token_s=decodes[0].plain_s, per_token_s=per_token, decodes=decodes)


def speculation_for(
    config: EngineConfig, scheduler: Scheduler, executor: Executor, draft: LoadedDraft | None = None
) -> Callable[[RequestState], SamplesTokens] | None:
    """What makes a plain request speculative, with the back-off policy measured on `executor` now; None (no
    `speculative_config`, or an allocator without `trim`: the contiguous KV manager). `draft`: the draft model
    of method draft_model, whose measured step time the policy adds per draft."""
    spec = config.speculative_config
    if spec is None:
        return None
    if not scheduler.supports_drafts:
        logger.warning(
            "speculative decoding is off: the %s KV manager cannot trim", config.cache_config.kv_manager
        )
        return None
    costs = measure_step_costs(
        executor, scheduler.max_num_batched_tokens, scheduler.max_model_len, scheduler.config.max_num_seqs
    )
    logger.info(
        "speculative decoding (%s, k=%d): a decode step costs %s (sequences: ms plain / ms per drafted token)",
        spec.method,
        spec.k,
        ", ".join(
            f"{d.batch_size}: {d.plain_s * 1e3:.3g} / {d.per_draft_s * 1e3:.2g}" for d in costs.decodes
        ),
    )
    if draft is None:
        return build_speculation(spec, DraftPolicy(costs, spec.k))
    logger.info("speculative decoding: a draft model step costs %.3g ms", draft.token_seconds * 1e3)
    policy = DraftPolicy(costs, spec.k, draft_token_s=draft.token_seconds)
    return build_speculation(spec, policy, draft.drafter)


class AcceptanceLog:
    """Logs the mean acceptance length (tokens per drafted step: 1 + accepted drafts per draft) at most every
    `interval_s`, over the drafts verified since the last line."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last_time: float | None = None
        self._last = (0, 0, 0)  # drafts, draft tokens, accepted tokens at the last line

    def observe(self, counters: TokenCounters, now: float) -> None:
        """Log if `interval_s` passed since the last line (the first call only starts the clock)."""
        if self._last_time is None:
            self._last_time = now
            return
        if now - self._last_time < self.interval_s:
            return
        current = (
            counters.spec_decode_num_drafts,
            counters.spec_decode_num_draft_tokens,
            counters.spec_decode_num_accepted_tokens,
        )
        drafts, tokens, accepted = (c - p for c, p in zip(current, self._last, strict=True))
        self._last_time, self._last = now, current
        if drafts:
            logger.info(
                "speculative decoding: mean acceptance length %.2f, %.1f%% of %d draft tokens accepted",
                1 + accepted / drafts,
                100 * accepted / max(tokens, 1),
                tokens,
            )


class Drafting(Extension):
    """After each step: count the verified drafts (vLLM's spec-decode metrics, a periodic acceptance log) and,
    with a draft model, draft for every sequence the step queued at it, in one batch."""

    def __init__(self, counters: TokenCounters, drafter: DraftModel | None = None) -> None:
        self.counters = counters
        self.drafter = drafter
        self.log = AcceptanceLog()

    def after_update(self, scheduler: Scheduler, sampled: SampledStep, now: float) -> None:
        """Count the step's verified chunks; draft the queued sequences' next tokens."""
        if sampled.verified:
            self.counters.count_drafts(sampled.verified)
            self.log.observe(self.counters, now)
        if self.drafter is not None:
            self.drafter.draft(scheduler)
