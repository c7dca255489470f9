"""What preempting costs: the policy `preemption_mode="auto"` consults to choose swap or recompute per victim.

The scheduler owns the mechanism (moving blocks, resetting computed tokens); a `PreemptionCostModel` only
prices the two ways. An engine measures its own (the server's `measure_preemption_costs`); tests force one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

PreemptionChoice = Literal["recompute", "swap"]


class PreemptionCostModel(Protocol):
    """Seconds each way of preempting a victim costs."""

    def swap_seconds(self, num_blocks: int) -> float:
        """Copying `num_blocks` KV blocks to the host tier and back."""
        ...

    def recompute_seconds(self, num_tokens: int) -> float:
        """Computing `num_tokens` tokens again as a prefill."""
        ...


@dataclass(frozen=True, slots=True)
class MeasuredPreemptionCosts:
    """Costs from start-up measurements: a host copy has a fixed latency plus bytes over bandwidth, a prefill
    a rate. The fixed latency (launches, a synchronisation) is what makes recompute win for short victims."""

    bytes_per_block: int
    host_copy_bytes_per_s: float  # device <-> host tier
    host_copy_latency_s: float  # one swap of one block, beyond its bytes
    prefill_tokens_per_s: float

    def swap_seconds(self, num_blocks: int) -> float:
        """Out now and back in later: two copies."""
        one_way = self.host_copy_latency_s + num_blocks * self.bytes_per_block / self.host_copy_bytes_per_s
        return 2.0 * one_way

    def recompute_seconds(self, num_tokens: int) -> float:
        """Tokens over the measured prefill rate."""
        return num_tokens / self.prefill_tokens_per_s


def choose_preemption(costs: PreemptionCostModel, num_blocks: int, num_tokens: int) -> PreemptionChoice:
    """The cheaper way to preempt a victim holding `num_blocks` blocks of `num_tokens` computed tokens."""
    return "swap" if costs.swap_seconds(num_blocks) < costs.recompute_seconds(num_tokens) else "recompute"
