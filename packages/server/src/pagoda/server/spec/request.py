"""Speculative requests: a plain request that drafts its next tokens (the EngineRequest of a speculative row).

`DraftingRequest` is the plain request it wraps (`DraftableRequest`: the engine's `RequestState`) in every call
but one: `end_step`, after the step's tokens are in, gets drafts for each running sample (`propose`) and hands
them to the scheduler, which computes them with the next decode. `SpeculativeRequest` proposes with a per-sample
`Proposer` (n-gram, suffix); `draft_request.DraftModelRequest` queues its samples at the engine's draft model. The
step's rows for the drafted positions and the accepted run are the step sampler's (`pagoda.server.spec.verify`);
`step()` has no branch for them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

from pagoda.scheduler import Request, Scheduler
from pagoda.server.outputs import RequestOutput
from pagoda.server.request_contract import DrawSpec, SamplesTokens, ScoresPrompt
from pagoda.server.sampling import TokenLogprobs
from pagoda.server.spec.policy import AcceptanceEstimate
from pagoda.server.spec.proposer import Proposer

# How many drafts a sequence gets next, given the scheduler and its acceptance rate so far (the back-off
# policy, `DraftPolicy`); 0: none.
DraftBudget = Callable[[Scheduler, float], int]


class DraftableRequest(SamplesTokens, ScoresPrompt, Protocol):
    """What a speculative request wraps: a plain request, whose rows the sampler draws (the engine's
    `RequestState`; grammar and beam rows are never drafted)."""


class DraftingRequest(ABC):
    """A plain request whose running samples get drafts after each step they progressed in (`propose`: where
    the drafts come from)."""

    def __init__(self, state: DraftableRequest, budget: DraftBudget) -> None:
        """Wrap `state` (no grammar, no beams: those rows are never drafted); `budget` caps each step's drafts."""
        self.state = state
        self.budget = budget
        self.acceptance = AcceptanceEstimate()  # over all its samples: they share one text
        self._proposed: dict[str, int] = {}  # sequence id -> drafts proposed for its next step
        self._added: dict[str, int] = {}  # sequence id -> tokens it got in this step

    @property
    def request_id(self) -> str:
        """The user's request id."""
        return self.state.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt."""
        return self.state.prompt_token_ids

    @property
    def seq_ids(self) -> tuple[str, ...]:
        """Its n samples' sequence ids."""
        return self.state.seq_ids

    @property
    def finished(self) -> bool:
        """True once every sample finished."""
        return self.state.finished

    @property
    def prompt_logprobs_k(self) -> int | None:
        """Top-k of the prompt logprobs still to compute."""
        return self.state.prompt_logprobs_k

    def add_prompt_logprobs(self, start: int, logprobs: list[TokenLogprobs]) -> None:
        """Record prompt logprobs."""
        self.state.add_prompt_logprobs(start, logprobs)

    def mark_scheduled(self, num_computed_tokens: int, now: float) -> None:
        """Note a scheduled chunk."""
        self.state.mark_scheduled(num_computed_tokens, now)

    def draw_spec(self, seq_id: str) -> DrawSpec:
        """The sampler draws every row (drafted positions too)."""
        return self.state.draw_spec(seq_id)

    def add_token(self, seq_id: str, token_id: int, logprobs: TokenLogprobs | None, now: float) -> str | None:
        """Record one token of the accepted run; the stop string it completes, if any."""
        self._added[seq_id] = self._added.get(seq_id, 0) + 1
        return self.state.add_token(seq_id, token_id, logprobs, now)

    def finish_as_scheduled(self, request: Request, stop_string: str | None) -> None:
        """Finish the sample the scheduler finished."""
        self.state.finish_as_scheduled(request, stop_string)

    def end_step(self, scheduler: Scheduler) -> bool:
        """Close the step, then propose each running, decoding sample's drafts for the next one."""
        changed = self.state.end_step(scheduler)
        for seq_id, num_added in self._added.items():
            proposed = self._proposed.pop(seq_id, 0)
            if proposed and num_added:  # the scheduler may have cut the drafts: an estimate then
                self.acceptance.update(proposed, min(num_added - 1, proposed))
        self._added.clear()
        k = self.budget(scheduler, self.acceptance.budget_rate)
        if k == 0:  # no drafts this step (acceptance too low, or a batch too large): probe again later
            self.acceptance.relax()
        for seq_id in self.state.seq_ids:
            request = scheduler.get_request(seq_id)
            if request is None or request.num_tokens - request.num_computed_tokens != 1:
                continue  # finished, or mid-prefill (a prompt chunk, or a recompute after preemption)
            self.propose(scheduler, seq_id, request, k)
        return changed

    @abstractmethod
    def propose(self, scheduler: Scheduler, seq_id: str, request: Request, k: int) -> None:
        """Give running sample `seq_id` up to `k` drafts for the scheduler's next step (`note_proposed` them)."""

    def note_proposed(self, seq_id: str, num_drafts: int) -> None:
        """Record how many drafts `seq_id` got for its next step (its acceptance is measured against them)."""
        self._proposed[seq_id] = num_drafts

    def snapshot(self) -> RequestOutput:
        """Its cumulative output now."""
        return self.state.snapshot()

    def abort(self) -> RequestOutput | None:
        """Finish every sample as aborted."""
        return self.state.abort()


class SpeculativeRequest(DraftingRequest):
    """A plain request whose running samples get drafts from their proposers (n-gram, suffix)."""

    def __init__(
        self, state: DraftableRequest, proposer: Callable[[], Proposer], budget: DraftBudget
    ) -> None:
        """Wrap `state`; `proposer()` makes the proposer of each of its samples (a proposer may keep
        per-sequence state, as the suffix index cursor)."""
        super().__init__(state, budget)
        self.make_proposer = proposer
        self.proposers: dict[str, Proposer] = {}

    def propose(self, scheduler: Scheduler, seq_id: str, request: Request, k: int) -> None:
        """Give running sample `seq_id` up to `k` drafts (its proposer's), for the scheduler's next step."""
        proposer = self.proposers.get(seq_id)
        if proposer is None:
            proposer = self.proposers[seq_id] = self.make_proposer()
        drafts = proposer.propose(request.all_token_ids, k) if k else ()
        scheduler.set_draft_token_ids(seq_id, drafts)
        self.note_proposed(seq_id, len(drafts))
