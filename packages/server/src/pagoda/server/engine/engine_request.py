"""`EngineRequest`: a user request as the engine drives it, whatever feature it carries.

The engine keeps one owner map, scheduler sequence id -> EngineRequest, and drives every request through the
same calls each step (see `pagoda.server.engine.llm_engine` for the contract). `RequestState` (plain sampling),
`BeamGroup` (beam search) and `pooling.PoolingRequest` (embeddings) implement it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import xgrammar as xgr
from pagoda.scheduler import Request, Scheduler
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling import SamplingRow, TokenLogprobs
from pagoda.server.sampling.logits_processors import LogitsEdits
from torch import Tensor


@dataclass(frozen=True, slots=True)
class DrawSpec:
    """What the sampler needs to draw one sequence's next token from its logits row."""

    row: SamplingRow
    edits: LogitsEdits  # logit_bias, allowed_token_ids, bad_words (applied to a copy of the row)
    matcher: xgr.GrammarMatcher | None  # the sequence's grammar state; None: unconstrained


class EngineRequest(Protocol):
    """One user request as the engine drives it: rows it needs, what it got, finishing, snapshot, abort.

    Per step the engine calls, in order: `mark_scheduled` for each scheduled chunk of its sequences;
    `draw_spec` for each row it samples; then `add_token` (the sampler drew the row) or `add_logprob_row` (the
    spec was None: the request takes the row's log-probabilities and chooses its tokens itself, the scheduler
    holding the sequence); `finish_as_scheduled` for each sequence the scheduler finished; and `end_step`
    once, after the scheduler's update. `abort` ends it early, whatever its state.
    """

    @property
    def request_id(self) -> str:
        """The user's request id (the scheduler runs the first sequence under it)."""
        ...

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt, as the scheduler got it."""
        ...

    @property
    def seq_ids(self) -> tuple[str, ...]:
        """The scheduler sequences it owns now (the engine's owner map keys)."""
        ...

    @property
    def finished(self) -> bool:
        """True once it has nothing left to run (the engine forgets it)."""
        ...

    @property
    def prompt_logprobs_k(self) -> int | None:
        """Top-k of the prompt logprobs still to compute; None when none are (any more)."""
        ...

    def add_prompt_logprobs(self, start: int, logprobs: list[TokenLogprobs]) -> None:
        """Record the logprobs of the prompt tokens after positions start, start + 1, ..."""
        ...

    @property
    def hidden_states_end(self) -> int | None:
        """Positions before this end have their final hidden states handed over (`add_hidden_states`); None: none.

        A pooling request's is its prompt length until it has pooled; the others' is None.
        """
        ...

    def add_hidden_states(
        self,
        start: int,
        hidden: Tensor,  # [num_rows, hidden_size]: final hidden states of positions start, start + 1, ...
    ) -> None:
        """Take a chunk's final hidden states (after the model's final norm), as `hidden_states_end` asked."""
        ...

    def mark_scheduled(self, num_computed_tokens: int, now: float) -> None:
        """Note a scheduled chunk of one of its sequences, starting at `num_computed_tokens`, at time `now`."""
        ...

    def draw_spec(self, seq_id: str) -> DrawSpec | None:
        """How the sampler draws sequence `seq_id`'s next token; None: it takes the row's log-probabilities."""
        ...

    def add_token(self, seq_id: str, token_id: int, logprobs: TokenLogprobs | None, now: float) -> str | None:
        """Record sequence `seq_id`'s drawn token; the stop string it completes, if any."""
        ...

    def add_logprob_row(
        self,
        seq_id: str,
        logprobs: Tensor,  # float32 [vocab]: log-softmax of the sequence's raw logits row
    ) -> None:
        """Take the row of a sequence whose `draw_spec` was None (the scheduler holds it)."""
        ...

    def finish_as_scheduled(self, request: Request, stop_string: str | None) -> None:
        """Finish the sequence the scheduler finished, for its reason."""
        ...

    def end_step(self, scheduler: Scheduler) -> bool:
        """Close a step that gave it rows (held sequences may be rewritten); True: it has a snapshot to report."""
        ...

    def snapshot(self) -> RequestOutput:
        """Its cumulative output now."""
        ...

    def abort(self) -> RequestOutput | None:
        """Finish it as aborted; its final snapshot, or None when it reports none."""
        ...
