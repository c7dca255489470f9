"""Admission rules: which waiting requests may join the running batch, beside seats, budgets and blocks.

A rule is policy, like the `SchedulingPolicy`: it looks at requests only, never at blocks or slots. The
scheduler asks every rule before it admits or swaps in a request; a request a rule holds back keeps its place
in the queue, and the rule says which later requests wait behind it (`holds_behind`), so that a steady stream
of requests the rule lets through cannot keep the held one out forever.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagoda.scheduler.config import SchedulerConfig
from pagoda.scheduler.request import Request


class AdmissionRule(Protocol):
    """A constraint on which requests may run together in one batch."""

    def fits(self, request: Request, running: Sequence[Request]) -> bool:
        """Whether `request` may join `running` now."""
        ...

    def holds_behind(self, request: Request) -> bool:
        """Whether `request` waits behind an earlier request this rule held back in the same admission pass."""
        ...


class AdapterCap:
    """At most `max_adapters` distinct adapters (`Request.lora_id`) in the running batch: vLLM's max_loras.

    Requests for the base model always fit and never wait behind a held adapter request (they take no slot);
    a request for an adapter the batch already runs always fits.
    """

    def __init__(self, max_adapters: int) -> None:
        if max_adapters < 1:
            raise ValueError(f"max_adapters must be >= 1, got {max_adapters}")
        self.max_adapters = max_adapters

    def fits(self, request: Request, running: Sequence[Request]) -> bool:
        """Whether `request`'s adapter is running already or a slot is left for it."""
        if request.lora_id is None:
            return True
        active = {r.lora_id for r in running if r.lora_id is not None}
        return request.lora_id in active or len(active) < self.max_adapters

    def holds_behind(self, request: Request) -> bool:
        """Every adapter request waits behind a held one; base-model requests pass."""
        return request.lora_id is not None


def build_rules(config: SchedulerConfig) -> tuple[AdmissionRule, ...]:
    """The rules `config` asks for: an adapter cap under `max_loras`."""
    return () if config.max_loras is None else (AdapterCap(config.max_loras),)
