"""pagoda.scheduler: continuous-batching scheduler (token budget, chunked prefill, prefix-cache-aware
admission, preemption by recompute or swap, parallel sampling) over Protocols it declares; stdlib only."""

from pagoda.scheduler.adaptive import AdaptivePolicy, StepPlanner, StepShape
from pagoda.scheduler.admission import AdapterCap, AdmissionRule, EncoderBudget, build_rules
from pagoda.scheduler.config import (
    PreemptionMode,
    SchedulerConfig,
    SchedulingPolicyName,
    SchedulingProfileName,
)
from pagoda.scheduler.contiguous import ContiguousKVManager, ContiguousStats
from pagoda.scheduler.cost_model import StepSample, StepTimeModel
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
from pagoda.scheduler.profiles import PRESETS, ProfilePreset, apply_profile, scaled_preset
from pagoda.scheduler.protocols import (
    KVBlockManager,
    KVCacheStatsLike,
    SamplingParamsLike,
    SlotAllocationLike,
    TrimmableKVBlockManager,
    WindowedKVBlockManager,
)
from pagoda.scheduler.request import EncoderSpan, Request, RequestRejectedError, RequestStatus, sample_id
from pagoda.scheduler.scheduler import Scheduler
from pagoda.scheduler.slo import RequestSLO, SLOCounts, SLOName, SLOTargets, SLOTracker, parse_slo_targets
from pagoda.scheduler.views import QueueEntry, QueueView

__all__ = [
    "PRESETS",
    "AdapterCap",
    "AdaptivePolicy",
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
    "ProfilePreset",
    "QueueEntry",
    "QueueView",
    "Request",
    "RequestRejectedError",
    "RequestSLO",
    "RequestStatus",
    "SLOCounts",
    "SLOName",
    "SLOTargets",
    "SLOTracker",
    "SamplingParamsLike",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SchedulingPolicy",
    "SchedulingPolicyName",
    "SchedulingProfileName",
    "SlotAllocationLike",
    "StaticBatchPolicy",
    "StepPlanner",
    "StepSample",
    "StepShape",
    "StepTimeModel",
    "TrimmableKVBlockManager",
    "WindowedKVBlockManager",
    "apply_profile",
    "build_policy",
    "build_rules",
    "choose_preemption",
    "parse_slo_targets",
    "sample_id",
    "scaled_preset",
]
