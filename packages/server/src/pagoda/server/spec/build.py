"""`build_speculation`: what the engine wraps a plain request in under a `SpeculativeConfig`."""

from __future__ import annotations

from collections.abc import Callable

from pagoda.scheduler import Scheduler
from pagoda.server.request_contract import SamplesTokens
from pagoda.server.spec.auto import AutoProposer
from pagoda.server.spec.config import SpeculativeConfig
from pagoda.server.spec.draft_model import DraftModel
from pagoda.server.spec.draft_request import DraftModelRequest
from pagoda.server.spec.ngram import NgramProposer
from pagoda.server.spec.policy import DraftPolicy
from pagoda.server.spec.proposer import Proposer
from pagoda.server.spec.request import DraftableRequest, SpeculativeRequest
from pagoda.server.spec.suffix import SuffixIndex, SuffixProposer


def build_speculation(
    config: SpeculativeConfig, policy: DraftPolicy | None = None, drafter: DraftModel | None = None
) -> Callable[[DraftableRequest], SamplesTokens]:
    """What makes a plain request speculative under `config` (each request gets its own proposer); `policy`
    backs off by batch size and acceptance (None: always `config.k` drafts); `drafter` is the
    engine's draft model (method draft_model: required)."""
    k = config.k

    # From this batch size on no sequence drafts, whatever its acceptance: a saturated engine pays one comparison
    # per request and step for speculation, not the policy's search.
    saturated = None if policy is None else policy.first_batch_without_drafts()

    def budget(scheduler: Scheduler, acceptance: float) -> int:
        if policy is None:
            return k
        batch_size = len(scheduler.running)
        if saturated is not None and batch_size >= saturated:
            return 0
        return policy.num_drafts(batch_size, acceptance)

    # suffix, auto: one index for the engine, so that a request drafts from the others' recent sequences too.
    index = SuffixIndex() if config.method in ("suffix", "auto") else None

    def proposer() -> Proposer:
        if index is not None and config.method == "auto":
            return AutoProposer(index, k, config.prompt_lookup_min, config.prompt_lookup_max)
        if index is not None:
            return SuffixProposer(index, k)
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)

    if config.method == "draft_model":
        if drafter is None:
            raise ValueError("method 'draft_model' drafts with the engine's draft model: none was given")
        model = drafter

        def draft(state: DraftableRequest) -> SamplesTokens:
            return DraftModelRequest(state, model, budget)

        return draft

    def speculate(state: DraftableRequest) -> SamplesTokens:
        return SpeculativeRequest(state, proposer, budget)

    return speculate
