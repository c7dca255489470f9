"""Helpers for tests, simulators and benchmarks of the scheduler; the engine imports none of them.

`sim`: `TokenCacheModel`, a token-level stand-in for the model runner, and `reference_output`, what it must
produce; `SimSamplingParams`, a minimal `SamplingParamsLike`. `contiguous`: `ContiguousKVManager`, contiguous
per-request KV preallocation over any `KVBlockManager` (the simulator's baseline). `costs`:
`ThresholdPreemptionCosts`, a forced cost model for `preemption_mode="auto"`.
"""

from pagoda.scheduler.testing.contiguous import ContiguousKVManager, ContiguousStats
from pagoda.scheduler.testing.costs import ThresholdPreemptionCosts
from pagoda.scheduler.testing.sim import (
    RunResult,
    SimSamplingParams,
    TokenCacheModel,
    reference_output,
    run_to_completion,
)

__all__ = [
    "ContiguousKVManager",
    "ContiguousStats",
    "RunResult",
    "SimSamplingParams",
    "ThresholdPreemptionCosts",
    "TokenCacheModel",
    "reference_output",
    "run_to_completion",
]
