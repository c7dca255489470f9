"""Helpers for tests, simulators and benchmarks of the scheduler; the engine imports none of them.

`sim`: `TokenCacheModel`, a token-level stand-in for the model runner, and `reference_output`, what it must
produce; `SimSamplingParams`, a minimal `SamplingParamsLike`. (`ContiguousKVManager`, which the engine runs too, is
`pagoda.scheduler.ContiguousKVManager` since 0.3.0.) `measure`: `kv_occupancy`, the share of reserved KV slots
that hold real tokens. `costs`: `ThresholdPreemptionCosts`, a forced cost model for `preemption_mode="auto"`.
`slo_sim`: goodput of a scheduling profile on a phased trace, simulated on a fake machine (imported from its
module).
"""

from pagoda.scheduler.testing.costs import ThresholdPreemptionCosts
from pagoda.scheduler.testing.measure import KVOccupancy, kv_occupancy
from pagoda.scheduler.testing.sim import (
    RunResult,
    SimSamplingParams,
    TokenCacheModel,
    reference_output,
    run_to_completion,
)

__all__ = [
    "KVOccupancy",
    "RunResult",
    "SimSamplingParams",
    "ThresholdPreemptionCosts",
    "TokenCacheModel",
    "kv_occupancy",
    "reference_output",
    "run_to_completion",
]
