"""pagoda.scheduler: continuous-batching scheduler (token budget, chunked prefill, prefix-cache-aware
admission, preemption by recompute or swap, parallel sampling) over Protocols it declares; stdlib only."""

from pagoda.scheduler.admission import AdapterCap, AdmissionRule, EncoderBudget, build_rules
from pagoda.scheduler.config import PreemptionMode, SchedulerConfig, SchedulingPolicyName
from pagoda.scheduler.contiguous import ContiguousKVManager, ContiguousStats
from pagoda.scheduler.output import ScheduledRequest, SchedulerOutput, SchedulerStats
from pagoda.scheduler.policy import (
    FCFSPolicy,
    PriorityPolicy,
    SchedulingPolicy,
    StaticBatchPolicy,
    build_policy,
)
from pagoda.scheduler.preemption import (
    MeasuredPreemptionCosts,
    PreemptionChoice,
    PreemptionCostModel,
    choose_preemption,
)
from pagoda.scheduler.protocols import (
    KVBlockManager,
    KVCacheStatsLike,
    SamplingParamsLike,
    SlotAllocationLike,
    TrimmableKVBlockManager,
)
from pagoda.scheduler.request import EncoderSpan, Request, RequestRejectedError, RequestStatus, sample_id
from pagoda.scheduler.scheduler import Scheduler
from pagoda.scheduler.views import QueueEntry, QueueView

__all__ = [
    "AdapterCap",
    "AdmissionRule",
    "ContiguousKVManager",
    "ContiguousStats",
    "EncoderBudget",
    "EncoderSpan",
    "FCFSPolicy",
    "KVBlockManager",
    "KVCacheStatsLike",
    "MeasuredPreemptionCosts",
    "PreemptionChoice",
    "PreemptionCostModel",
    "PreemptionMode",
    "PriorityPolicy",
    "QueueEntry",
    "QueueView",
    "Request",
    "RequestRejectedError",
    "RequestStatus",
    "SamplingParamsLike",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SchedulingPolicy",
    "SchedulingPolicyName",
    "SlotAllocationLike",
    "StaticBatchPolicy",
    "TrimmableKVBlockManager",
    "build_policy",
    "build_rules",
    "choose_preemption",
    "sample_id",
]
