"""Start-up measurements for `--preemption-mode auto`: how fast this machine copies KV blocks to the host tier
and back, and how fast it prefills, as the scheduler's `MeasuredPreemptionCosts`."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch
from pagoda.scheduler import MeasuredPreemptionCosts, ScheduledRequest, SchedulerOutput
from pagoda.server.engine.executor.base import Executor

logger = logging.getLogger("pagoda.engine")

# Small enough to keep the engine's start within tens of milliseconds on a 2-core CPU with the default model.
_PROBE_BLOCKS = 32
_PROBE_TOKENS = 16


def _best_seconds(run: Callable[[], object], device: torch.device, rounds: int) -> float:
    """The fastest of `rounds` timed runs (device work included)."""
    best = math.inf
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _probe_step(num_tokens: int, block_size: int) -> SchedulerOutput:
    """One prefill of `num_tokens` tokens into the first blocks of the (still empty) pool."""
    chunk = ScheduledRequest(
        request_id="preemption-probe",
        token_ids=(0,) * num_tokens,
        start=0,
        num_tokens=num_tokens,
        block_table=tuple(range(-(-num_tokens // block_size))),
        slots=tuple(range(num_tokens)),
        num_samples=1,
        sample_ids=("preemption-probe",),
    )
    return SchedulerOutput((chunk,), (), (), (), (), (), num_tokens)


def measure_preemption_costs(
    executor: Executor, max_num_batched_tokens: int, max_model_len: int
) -> MeasuredPreemptionCosts:
    """Time a one-block and a many-block swap out, and a short prefill, on the engine's own caches and model.

    Runs before any request, so the blocks it writes hold nothing. The first prefill is a warm-up (kernel
    selection; on CUDA, torch.compile's compilation, which the first request would otherwise pay). The copies
    are timed on the driver's shard alone (every rank copies its shard in parallel); the prefill on every rank.
    """
    kv, device = executor.driver.kv_cache, executor.driver.device
    # The scheduler prices a victim by its block positions (group 0's table): with KV cache groups a position
    # moves one block of each group (an upper bound where a window already released some).
    groups = 1 if kv.shape.layout is None else len(kv.shape.layout.groups)
    bytes_per_block = kv.shape.bytes_per_block
    num_blocks = min(kv.num_blocks, kv.num_host_blocks, _PROBE_BLOCKS)
    if num_blocks < 2:  # no host tier to speak of: swapping is never the choice
        bandwidth, latency = 1.0, math.inf
    else:
        one = _best_seconds(lambda: kv.swap_out(((0, 0),)), device, 3)
        many_pairs = tuple((i, i) for i in range(num_blocks))
        many = _best_seconds(lambda: kv.swap_out(many_pairs), device, 3)
        per_block = max((many - one) / (num_blocks - 1), 1e-12)
        bandwidth, latency = bytes_per_block / per_block, max(one - per_block, 0.0)
    block_size = kv.shape.block_size
    num_tokens = min(_PROBE_TOKENS, max_num_batched_tokens, max_model_len, kv.num_blocks * block_size)
    step = _probe_step(num_tokens, block_size)
    executor.execute(step, {})  # warm-up
    prefill = _best_seconds(lambda: executor.execute(step, {}), device, 1)
    costs = MeasuredPreemptionCosts(
        bytes_per_block * groups, bandwidth, latency, num_tokens / max(prefill, 1e-9)
    )
    logger.info(
        "preemption auto: host copies %.3g GB/s + %.3g ms each, prefill %.0f tokens/s",
        bandwidth / 1e9,
        latency * 1e3,
        costs.prefill_tokens_per_s,
    )
    return costs
