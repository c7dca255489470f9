"""`PoolingRequest`: an embedding or score request as the engine drives it, prefill only.

Its prompt goes through the same scheduler and paged KV as any request (chunked prefill, batching, preemption).
It takes the final hidden states of its prompt positions (`TakesHiddenStates`), a chunk at a time, into its
`Pooler`. The last chunk's logits row is handed to it (`TakesLogprobRows`: the scheduler appends nothing) and
its `end_step` finishes the sequence, so its KV blocks are freed in that same step. A `score` request's pooled
row then goes through the model's classification head (`ScoreHead`): its output is the score.
"""

from __future__ import annotations

import time

from pagoda.scheduler import RequestStatus, Scheduler
from pagoda.server.outputs import RequestMetrics, RequestOutput
from pagoda.server.pooling.classifier import ScoreHead
from pagoda.server.pooling.params import PoolingParams
from pagoda.server.pooling.pooler import Pooler
from torch import Tensor


class PoolingRequest:
    """One prompt to embed: its pooler, timings and, once its prefill is done, the pooled vector."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: tuple[int, ...],
        params: PoolingParams,
        arrival_time: float,
        head: ScoreHead | None = None,  # a `score` task's: the model's classification head
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.head = head
        last = None if head is None else head.pool_position(prompt_token_ids)
        self.pooler = Pooler(params, len(prompt_token_ids), last)
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.embedding: tuple[float, ...] | None = None
        self.finished = False
        self._aborted = False

    @property
    def seq_ids(self) -> tuple[str, ...]:
        """Its one sequence, under its own id (nothing forks; the engine forgets it by this id once finished)."""
        return (self.request_id,)

    @property
    def hidden_states_end(self) -> int | None:
        """Every prompt position's hidden state comes back until the pooler has what it needs."""
        return None if self.pooler.done else len(self.prompt_token_ids)

    def add_hidden_states(
        self,
        start: int,
        hidden: Tensor,  # [num_rows, hidden_size]: final hidden states of positions start, start + 1, ...
    ) -> None:
        """Pool a chunk's rows."""
        self.pooler.add(start, hidden)

    def mark_scheduled(self, num_computed_tokens: int, now: float) -> None:
        """Note the first chunk (admission starts it at its prefix-cache hit)."""
        if self.metrics.first_scheduled_time is None:
            self.num_cached_tokens = num_computed_tokens
            self.metrics = RequestMetrics(self.metrics.arrival_time, first_scheduled_time=now)

    def add_logprob_row(self, seq_id: str, logprobs: Tensor) -> None:  # float32 [vocab]
        """The prefill is complete: the row itself is not needed, the pooler has every position."""

    def end_step(self, scheduler: Scheduler) -> bool:
        """After the last chunk: finish the held sequence (its KV freed now) and pool; True once finished."""
        if not self.finished and self.pooler.done:
            scheduler.finish_sequence(self.request_id, RequestStatus.FINISHED_STOPPED)
            pooled = self.pooler.result()
            if self.head is not None:  # a cross-encoder's score: its head on the pooled row
                pooled = self.head(pooled, self.pooler.params.use_activation)
            self.embedding = tuple(pooled.tolist())
            self._finish()
        return self.finished

    def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            m = self.metrics
            self.metrics = RequestMetrics(
                m.arrival_time, first_scheduled_time=m.first_scheduled_time, finished_time=time.monotonic()
            )

    def abort(self) -> RequestOutput:
        """Finish it as aborted, without a vector; the final snapshot."""
        self._aborted = True
        self._finish()
        return self.snapshot()

    def snapshot(self) -> RequestOutput:
        """No samples; the pooled vector once finished."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=(),
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            embedding=None if self._aborted else self.embedding,
        )
