"""A forced preemption cost model, so that tests decide which victims `preemption_mode="auto"` swaps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ThresholdPreemptionCosts:
    """Swapping is cheaper exactly for victims holding at least `min_swap_blocks` blocks."""

    min_swap_blocks: int

    def swap_seconds(self, num_blocks: int) -> float:
        """0 s at or above the threshold, 2 s below it (recompute always costs 1 s)."""
        return 0.0 if num_blocks >= self.min_swap_blocks else 2.0

    def recompute_seconds(self, num_tokens: int) -> float:
        """1 s, whatever the length."""
        return 1.0
