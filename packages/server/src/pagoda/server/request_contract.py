"""The per-request contract: what the engine calls on every request, and the capabilities a request may add.

A user request is an `EngineRequest`: its ids, whether it has finished, its scheduled chunks, the close of each
step, its snapshot and its abort. How it gets its sample rows is a capability, resolved once when the engine
takes the request in (never per row):

- `SamplesTokens`: the sampler draws each row (`draw_spec`), the request records the tokens (`add_token`) and
  finishes as the scheduler's stop rules say (`finish_as_scheduled`). Plain and speculative requests.
- `TakesLogprobRows`: each row's float32 log-softmax is handed over and the scheduler holds the sequence until
  the request extends it (beam search), or the request finishes it (pooling).

and two more are optional on top:

- `ScoresPrompt`: prompt logprobs (the LM head over the prompt positions' hidden states, a slice at a time).
- `TakesHiddenStates`: the prompt positions' final hidden states themselves (pooling).

A request implements exactly what it uses: no member of this module is a stub anywhere. The module sits below
the engine, so that `spec/`, `pooling/` and the engine's request types import it at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pagoda.scheduler import Request, Scheduler
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling import SamplingRow, TokenLogprobs
from pagoda.server.sampling.logits_processors import LogitsEdits
from torch import Tensor

if TYPE_CHECKING:  # xgrammar takes ~0.4 s to import: loaded at the first constrained request, not at start
    import xgrammar as xgr


@dataclass(frozen=True, slots=True)
class DrawSpec:
    """What the sampler needs to draw one sequence's next token from its logits row."""

    row: SamplingRow
    edits: LogitsEdits  # logit_bias, allowed_token_ids, bad_words (applied to a copy of the row)
    matcher: xgr.GrammarMatcher | None  # the sequence's grammar state; None: unconstrained


@runtime_checkable
class EngineRequest(Protocol):
    """One user request as the engine drives it: its sequences, its chunks, the end of each step, its output.

    Per step the engine calls `mark_scheduled` for each scheduled chunk of its sequences; hands each of its rows
    over through its row capability (`SamplesTokens` or `TakesLogprobRows`); then calls `end_step` once, after
    the scheduler's update, if a row or a finish reached it. `abort` ends it early, whatever its state.
    """

    @property
    def request_id(self) -> str:
        """The user's request id (the scheduler runs the first sequence under it)."""
        ...

    @property
    def seq_ids(self) -> tuple[str, ...]:
        """The scheduler sequences it owns now (the engine's owner map keys)."""
        ...

    @property
    def finished(self) -> bool:
        """True once it has nothing left to run (the engine forgets it)."""
        ...

    def mark_scheduled(self, num_computed_tokens: int, now: float) -> None:
        """Note a scheduled chunk of one of its sequences, starting at `num_computed_tokens`, at time `now`."""
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


@runtime_checkable
class SamplesTokens(EngineRequest, Protocol):
    """A request whose rows the sampler draws: each row's draw, its token, and the scheduler's finish."""

    def draw_spec(self, seq_id: str) -> DrawSpec:
        """How the sampler draws sequence `seq_id`'s next token."""
        ...

    def add_token(self, seq_id: str, token_id: int, logprobs: TokenLogprobs | None, now: float) -> str | None:
        """Record sequence `seq_id`'s drawn token; the stop string it completes, if any."""
        ...

    def finish_as_scheduled(self, request: Request, stop_string: str | None) -> None:
        """Finish the sequence the scheduler finished (a stop token, a length cap, a stop string), for its reason."""
        ...


@runtime_checkable
class TakesLogprobRows(EngineRequest, Protocol):
    """A request that chooses its tokens itself from each row's log-probabilities (the scheduler holds its
    sequences: nothing is appended, nothing finishes by the scheduler's stop rules)."""

    def add_logprob_row(
        self,
        seq_id: str,
        logprobs: Tensor,  # float32 [vocab]: log-softmax of the sequence's raw logits row
    ) -> None:
        """Take sequence `seq_id`'s row."""
        ...


@runtime_checkable
class ScoresPrompt(Protocol):
    """Prompt logprobs: the engine scores the prompt positions of its chunks over the LM head."""

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt (the scored targets are its tokens)."""
        ...

    @property
    def prompt_logprobs_k(self) -> int | None:
        """Top-k of the prompt logprobs still to compute; None when none are (any more)."""
        ...

    def add_prompt_logprobs(self, start: int, logprobs: list[TokenLogprobs]) -> None:
        """Record the logprobs of the prompt tokens after positions start, start + 1, ..."""
        ...


@runtime_checkable
class TakesHiddenStates(Protocol):
    """The final hidden states (after the model's final norm) of prompt positions, handed over as computed."""

    @property
    def hidden_states_end(self) -> int | None:
        """Positions before this end have their hidden states handed over; None: no more are needed."""
        ...

    def add_hidden_states(
        self,
        start: int,
        hidden: Tensor,  # [num_rows, hidden_size]: final hidden states of positions start, start + 1, ...
    ) -> None:
        """Take a chunk's final hidden states."""
        ...
