"""One beam-search request in the engine: the mechanism that maps the policy's decisions onto scheduler sequences.

Each running beam is a scheduler sequence. Its sampled logits row is *held* (the scheduler appends nothing and
parks the sequence) until every running beam of the group has a row for the same length; then the policy steps
once and the group is rewritten in the scheduler: beams no longer picked are finished (their blocks freed in
that step), a beam picked c times is forked c - 1 times (block tables shared by reference count, copy-on-write
on the next write into the shared last block), and each next beam gets its token appended. Beams of one group
may be scheduled, preempted or recomputed at different steps: holding rows is what keeps the group in step.

`BeamGroup` is beam search's `EngineRequest`, one that takes log-probability rows (`TakesLogprobRows`): the
engine hands it each beam's float32 log-softmax row (as transformers scores them) and holds the sequence in the
scheduler; `end_step` advances.
"""

from __future__ import annotations

import itertools
import time

import torch
from pagoda.scheduler import Scheduler, sample_id
from pagoda.server.beam_search import BeamSearchParams, BeamSearchPolicy, finish_reason
from pagoda.server.outputs import CompletionOutput, RequestMetrics, RequestOutput
from torch import Tensor
from transformers import PreTrainedTokenizerBase


class BeamGroup:
    """A beam-search request: its policy, its running beams' sequence ids, and the rows they are waiting on."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: tuple[int, ...],
        params: BeamSearchParams,
        num_outputs: int,
        eos_token_ids: frozenset[int],
        skip_special_tokens: bool,
        arrival_time: float,
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        """The scheduler forks the prompt into `beam_width` samples; they are the first running beams."""
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.num_outputs = num_outputs
        self.eos_token_ids = eos_token_ids
        self.skip_special_tokens = skip_special_tokens
        self.arrival_time = arrival_time
        self.tokenizer = tokenizer
        self.first_scheduled_time: float | None = None
        self.finished = False  # the policy has ended the search
        self.policy = BeamSearchPolicy(params, eos_token_ids)
        self.beams = [sample_id(request_id, i) for i in range(params.beam_width)]  # in the policy's order
        self.rows: dict[str, Tensor] = {}  # float32 [vocab] logprobs of each beam at the current length
        self._new_ids = (f"{request_id}:beam{i}" for i in itertools.count())

    @property
    def seq_ids(self) -> tuple[str, ...]:
        """The running beams."""
        return tuple(self.beams)

    def mark_scheduled(self, num_computed_tokens: int, now: float) -> None:
        """Note the first step that schedules one of its beams."""
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now

    def add_logprob_row(
        self,
        seq_id: str,
        logprobs: Tensor,  # float32 [vocab]
    ) -> None:
        """Hold beam `seq_id`'s next-token logprobs (a recomputed beam gives the same row again: it replaces it)."""
        self.rows[seq_id] = logprobs

    def end_step(self, scheduler: Scheduler) -> bool:
        """Advance once every running beam has its row; True when the search is over (its only snapshot)."""
        if not self.ready:
            return False
        self.finished = self.advance(scheduler)
        return self.finished

    def abort(self) -> None:
        """Nothing to report: a beam search streams nothing, and an aborted one returns no hypotheses."""

    @property
    def ready(self) -> bool:
        """Whether every running beam has its row."""
        return len(self.rows) == len(self.beams)

    def advance(self, scheduler: Scheduler) -> bool:
        """Step the policy and rewrite the group's sequences in `scheduler`; True when the search is over."""
        rows = [self.rows[seq_id] for seq_id in self.beams]
        self.rows.clear()
        step = self.policy.step(torch.stack(rows))
        if step.done:
            for seq_id in self.beams:
                scheduler.finish_sequence(seq_id)
            self.beams = []
            return True
        picked = set(step.parents)
        # Free the pruned beams first, so that the forks below never hold more than beam_width seats.
        for index, seq_id in enumerate(self.beams):
            if index not in picked:
                scheduler.finish_sequence(seq_id)
        # Fork before any append: a child copies its parent's tokens as they were before this step.
        claimed: set[int] = set()
        next_beams: list[str] = []
        for parent in step.parents:
            parent_id = self.beams[parent]
            if parent in claimed:
                child_id = next(self._new_ids)
                scheduler.fork_sequence(parent_id, child_id)
                next_beams.append(child_id)
            else:
                claimed.add(parent)
                next_beams.append(parent_id)
        for seq_id, token in zip(next_beams, step.tokens, strict=True):
            scheduler.append_token(seq_id, token)
        self.beams = next_beams
        return False

    def snapshot(self) -> RequestOutput:
        """The finished request: the best `num_outputs` hypotheses, best first."""
        now = time.monotonic()
        outputs = tuple(
            CompletionOutput(
                index=index,
                text=str(self.tokenizer.decode(list(h.tokens), skip_special_tokens=self.skip_special_tokens)),
                token_ids=h.tokens,
                cumulative_logprob=h.cum_logprob,
                logprobs=None,
                finish_reason=finish_reason(h.tokens, self.eos_token_ids, self.params.ignore_eos),
            )
            for index, h in enumerate(self.policy.hypotheses()[: self.num_outputs])
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=True,
            # Beam search streams nothing: the first tokens arrive with the finished request.
            metrics=RequestMetrics(self.arrival_time, self.first_scheduled_time, now, now, now),
        )
