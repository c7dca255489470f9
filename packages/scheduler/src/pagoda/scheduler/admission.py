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


def pending_encoder_tokens(request: Request) -> int:
    """Positions of `request`'s encoder spans not computed before its latest chunk: the encoder rows it still
    needs kept (a chunk scheduled in this step reads them when the step runs)."""
    done = min(request.num_computed_tokens, request.chunk_start)
    return sum(min(span.length, span.end - done) for span in request.encoder_spans if span.end > done)


class EncoderBudget:
    """The encoder cache's budget (vLLM's encoder cache size): the running requests' images not yet prefilled
    hold at most `max_tokens` encoder rows, so that their embeddings fit the cache until their chunks ran.

    A request without images always fits; a request with images fits when no running request still needs
    encoder rows, even beyond the budget (an image larger than the cache still runs, alone).
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens

    def fits(self, request: Request, running: Sequence[Request]) -> bool:
        """Whether `request`'s unprefilled images fit beside those of `running`."""
        needed = pending_encoder_tokens(request)
        if not needed:
            return True
        held = sum(pending_encoder_tokens(r) for r in running)
        return held == 0 or held + needed <= self.max_tokens

    def holds_behind(self, request: Request) -> bool:
        """Requests with images wait behind a held one; text requests pass."""
        return bool(request.encoder_spans)


def build_rules(config: SchedulerConfig) -> tuple[AdmissionRule, ...]:
    """The rules `config` asks for: an adapter cap under `max_loras`, an encoder budget under
    `encoder_cache_tokens`."""
    rules: list[AdmissionRule] = []
    if config.max_loras is not None:
        rules.append(AdapterCap(config.max_loras))
    if config.encoder_cache_tokens is not None:
        rules.append(EncoderBudget(config.encoder_cache_tokens))
    return tuple(rules)
