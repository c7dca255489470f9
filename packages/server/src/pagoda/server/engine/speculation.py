"""The engine's side of speculative decoding: whether its requests draft, what wraps them, and the engine
extension that counts the verified drafts and runs the draft model's batch after each step."""

from __future__ import annotations

import logging
from collections.abc import Callable

from pagoda.scheduler import Scheduler
from pagoda.server.config import EngineConfig
from pagoda.server.engine.counters import TokenCounters
from pagoda.server.engine.draft_setup import LoadedDraft
from pagoda.server.engine.executor.base import Executor
from pagoda.server.engine.extension import Extension
from pagoda.server.engine.preemption_costs import _best_seconds, _probe_step
from pagoda.server.engine.requests import RequestState
from pagoda.server.engine.step_sampler import SampledStep
from pagoda.server.request_contract import SamplesTokens
from pagoda.server.spec.build import build_speculation
from pagoda.server.spec.draft_model import DraftModel
from pagoda.server.spec.policy import DraftPolicy, StepCostModel

logger = logging.getLogger("pagoda.engine")

# The large probe step: enough tokens to leave the weight-bound regime on a CPU, few enough for a fast start.
_PROBE_TOKENS = 64


def measure_step_costs(executor: Executor, max_num_batched_tokens: int, max_model_len: int) -> StepCostModel:
    """Time a one-token step and a many-token step on the engine's model (before any request: the blocks it
    writes hold nothing), as the back-off policy's cost model."""
    block_size = executor.driver.kv_cache.shape.block_size
    device = executor.driver.device
    many = min(_PROBE_TOKENS, max_num_batched_tokens, max_model_len, executor.num_blocks * block_size)
    one_step, many_step = _probe_step(1, block_size), _probe_step(many, block_size)
    executor.execute(many_step, {})  # warm-up
    one = _best_seconds(lambda: executor.execute(one_step, {}), device, 3)
    big = _best_seconds(lambda: executor.execute(many_step, {}), device, 2)
    return StepCostModel(one_token_s=one, per_token_s=big / many)


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
    costs = measure_step_costs(executor, scheduler.max_num_batched_tokens, scheduler.max_model_len)
    logger.info(
        "speculative decoding (%s, k=%d): a step costs %.3g ms for 1 token, %.3g ms per token when large",
        spec.method,
        spec.num_speculative_tokens,
        costs.one_token_s * 1e3,
        costs.per_token_s * 1e3,
    )
    if draft is None:
        return build_speculation(spec, DraftPolicy(costs, spec.num_speculative_tokens))
    logger.info("speculative decoding: a draft model step costs %.3g ms", draft.token_seconds * 1e3)
    policy = DraftPolicy(costs, spec.num_speculative_tokens, draft_token_s=draft.token_seconds)
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
