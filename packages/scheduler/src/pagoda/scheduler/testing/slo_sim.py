"""Goodput of a scheduling profile on a phased trace, simulated: the real scheduler and policy (and the caller's
allocator) on a fake machine whose step time is `a + b * decode_rows + c * prefill_tokens + d * context_tokens / 1000` (seconds,
times a seeded noise factor), with a simulated clock. Seconds per trace instead of minutes per server, so that a
policy change can be judged on overloads a benchmark run takes a quarter of an hour to show
(`tools/simulate_adaptive.py`, `tests/scheduler/test_adaptive_sim.py`).

The trace mirrors the server benchmark's (`pagoda.server.bench.trace`): a chatty phase (prompts of 21-83 tokens,
answers of 16-64), a documents phase (1,800-3,600 tokens, answers of 8-32) and both mixed at half rates. A
request counts (goodput) when it meets both objectives: TTFT (arrival to the step that produced its first token)
and TPOT (the mean gap after it).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pagoda.scheduler.adaptive import AdaptivePolicy
from pagoda.scheduler.config import SchedulerConfig, SchedulingProfileName
from pagoda.scheduler.cost_model import StepSample
from pagoda.scheduler.output import SchedulerOutput
from pagoda.scheduler.policy import build_policy
from pagoda.scheduler.profiles import apply_profile
from pagoda.scheduler.protocols import KVBlockManager
from pagoda.scheduler.request import Request
from pagoda.scheduler.scheduler import Scheduler
from pagoda.scheduler.testing.sim import SimSamplingParams, TokenCacheModel

PHASES = ("chatty", "documents", "mixed")
# Builds the KV manager of a run: (num_blocks, block_size, enable_prefix_caching). The caller passes one (e.g.
# `pagoda.blockalloc.BlockManager`): the scheduler package imports no allocator.
KVFactory = Callable[[int, int, bool], KVBlockManager]
# The default model (Gemma 3 270M, its Q4_K_M GGUF) served on a 2-core AMD EPYC Zen 4: a least-squares fit of 6,964
# steps the server timed while serving the phased trace (`tools/bench_adaptive.py`, chats at 8-10/s): 17 ms a step,
# 2.4 ms a decode row, 0.95 ms a prefill token, 4 ms per 1,000 context tokens. (Past 16 rows the LM head leaves the
# int8 GEMV: a 28-row decode step takes 64-76 ms offline too.)
CPU_COSTS = (0.017, 0.0024, 0.00095, 0.004)
# The same model and CPU once a decode step of up to 64 rows ran in one native call (the adaptive server's start-up
# probes, 2026-12-05): 8.2 ms a step, 0.72 ms a decode row, 0.31 ms a prefill token, 0.05 ms per 1,000 context
# tokens. About 3x the capacity of `CPU_COSTS`: the chatty overload moves from 8-10 chats/s to 25-40.
NATIVE_CPU_COSTS = (0.00816, 0.000717, 0.000308, 0.0000511)
# The step costs by name (`tools/simulate_adaptive.py --machine`), read-only.
MACHINES: Mapping[str, tuple[float, float, float, float]] = MappingProxyType(
    {"modules": CPU_COSTS, "native": NATIVE_CPU_COSTS}
)


@dataclass(frozen=True, slots=True)
class TraceItem:
    """One request: arrival (s), phase, prompt and answer lengths (tokens)."""

    at: float
    phase: str
    prompt_len: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class PhaseResult:
    """A phase's requests, those meeting both objectives, and those missing each."""

    requests: int
    met: int
    ttft_missed: int
    tpot_missed: int


def phased_trace(
    seed: int, phase_seconds: float, chat_rate: float, document_rate: float = 0.25
) -> list[TraceItem]:
    """Poisson arrivals per phase (requests/s), the same for a seed."""
    rng = random.Random(seed)
    items: list[TraceItem] = []
    for index, phase in enumerate(PHASES):
        start = index * phase_seconds
        rates = {"chatty": [("chat", chat_rate)], "documents": [("doc", document_rate)]}.get(
            phase, [("chat", chat_rate / 2), ("doc", document_rate / 2)]
        )
        for kind, rate in rates:
            at = start + rng.expovariate(rate)
            while at < start + phase_seconds:
                if kind == "chat":
                    lengths = (rng.randint(16, 64) + 1, rng.randint(16, 64))
                else:
                    lengths = (rng.randint(1500, 3000) + 1, rng.randint(8, 32))
                items.append(TraceItem(at, phase, *lengths))
                at += rng.expovariate(rate)
    return sorted(items, key=lambda item: item.at)


class _Clock:
    """The simulated clock the adaptive policy reads."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step_seconds(out: SchedulerOutput, costs: tuple[float, float, float, float]) -> float:
    """The fake machine's time for a step (before noise)."""
    a, b, c, d = costs
    shape = StepSample.of(out, 0.0)  # the shape the scheduler reports to its policy
    return a + b * shape.decode_rows + c * shape.prefill_tokens + d * shape.context_tokens / 1000


def simulate(
    profile: SchedulingProfileName | None,
    trace: list[TraceItem],
    make_kv: KVFactory,
    *,
    costs: tuple[float, float, float, float] = CPU_COSTS,
    slo_ttft_s: float = 2.5,
    slo_tpot_s: float = 0.15,
    num_blocks: int = 4096,
    block_size: int = 16,
    seed: int = 1,
    noise: tuple[float, float] = (0.9, 1.15),
) -> dict[str, PhaseResult]:
    """Run `trace` under `profile` (None: the default configuration) over `make_kv`'s allocator; per phase, who
    met which objective. Only `adaptive` is told the objectives, as in the server benchmark. Each step takes the
    machine's time times a factor drawn uniformly from `noise` (seeded)."""
    clock = _Clock()
    told = profile == "adaptive"
    config = SchedulerConfig(
        max_model_len=8192,
        scheduling_profile=profile,
        slo_ttft_ms=((None, slo_ttft_s * 1000),) if told else (),
        slo_tpot_ms=((None, slo_tpot_s * 1000),) if told else (),
    )
    config = apply_profile(config, num_blocks, block_size)
    policy = build_policy(config, pool=(num_blocks, block_size))
    if isinstance(policy, AdaptivePolicy):
        policy.clock = clock
    scheduler = Scheduler(
        config,
        make_kv(num_blocks, block_size, config.enable_prefix_caching),
        policy,
    )
    runner = TokenCacheModel(num_blocks, block_size)
    rng = random.Random(seed)
    pending = list(trace)
    arrivals: dict[str, TraceItem] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0].at <= clock.now:
            item = pending.pop(0)
            rid = f"r{len(arrivals)}"
            prompt = [(len(arrivals) * 31 + j * 7) % 1000 + 1 for j in range(item.prompt_len)]
            scheduler.add_request(
                Request(rid, prompt, SimSamplingParams(max_tokens=item.max_tokens), arrival_time=item.at)
            )
            arrivals[rid] = item
        if not scheduler.has_unfinished_requests():
            clock.now = pending[0].at
            continue
        out = scheduler.schedule()
        seconds = step_seconds(out, costs) * rng.uniform(*noise)
        clock.now += seconds
        scheduler.update_from_output(out, runner.execute(out))
        scheduler.record_step(out, seconds)
        for rid in arrivals.keys() - last.keys():
            request = scheduler.get_request(rid)
            if request is None:  # finished this step
                first.setdefault(rid, clock.now)
                last[rid] = clock.now
            elif request.num_output_tokens and rid not in first:
                first[rid] = clock.now
    results: dict[str, PhaseResult] = {}
    for phase in PHASES:
        met = ttft_missed = tpot_missed = total = 0
        for rid, item in arrivals.items():
            if item.phase != phase:
                continue
            ttft_ok = first[rid] - item.at <= slo_ttft_s
            tpot_ok = (last[rid] - first[rid]) / max(1, item.max_tokens - 1) <= slo_tpot_s
            total += 1
            met += ttft_ok and tpot_ok
            ttft_missed += not ttft_ok
            tpot_missed += not tpot_ok
        results[phase] = PhaseResult(total, met, ttft_missed, tpot_missed)
    return results
