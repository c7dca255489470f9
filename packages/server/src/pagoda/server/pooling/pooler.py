"""The pooler: one vector of a prompt's final hidden states, taken a prefill chunk at a time."""

from __future__ import annotations

import torch
from pagoda.server.pooling.params import PoolingParams
from torch import Tensor


class Pooler:
    """Accumulates one prompt's hidden states chunk by chunk (LAST, MEAN or CLS) and gives the pooled vector.

    Only what the pooling type needs is kept (one row, or a float32 running sum), never the whole prompt. Rows
    arrive in position order; positions already taken (a recomputation after preemption) are skipped, so a
    mean never counts a position twice.
    """

    def __init__(self, params: PoolingParams, num_positions: int, last_position: int | None = None) -> None:
        """`params` as resolved by the engine (its --pooler-config filled in); LAST reads `last_position` (by
        default the prompt's last: a cross-encoder's is its last non-pad token, as transformers reads)."""
        self.params = params
        self.num_positions = num_positions
        self.last_position = num_positions - 1 if last_position is None else last_position
        self._next = 0  # the next position a MEAN or CLS pooler takes (it needs every one, in order)
        self._sum: Tensor | None = None  # float32 [hidden_size]: MEAN's sum so far
        self._row: Tensor | None = None  # float32 [hidden_size]: LAST's or CLS's row

    @property
    def done(self) -> bool:
        """Whether every position the pooling type reads has been taken."""
        if self.params.kind == "MEAN":
            return self._next >= self.num_positions
        return self._row is not None

    def add(
        self,
        start: int,
        hidden: Tensor,  # [num_rows, hidden_size]: final hidden states of positions start, start + 1, ...
    ) -> None:
        """Take the rows of positions start, start + 1, ... that this pooler still needs."""
        kind = self.params.kind
        end = start + hidden.shape[0]
        if kind == "LAST":
            if start <= self.last_position < end:
                self._row = hidden[self.last_position - start].float().clone()
            return
        if start > self._next or end <= self._next:
            return  # nothing new (MEAN and CLS requests skip the prefix cache: no gap can open)
        rows = hidden[self._next - start :]
        if kind == "CLS":
            if self._next == 0:
                self._row = rows[0].float().clone()
        else:
            part = rows.float().sum(dim=0)
            self._sum = part if self._sum is None else self._sum + part
        self._next = end

    def result(self) -> Tensor:  # float32 [dimensions or hidden_size]
        """The pooled vector, cut to the Matryoshka width and L2-normalised as the params say (a `score` task's
        row as pooled: its head reads it)."""
        if self.params.kind == "MEAN":
            assert self._sum is not None, "a MEAN pooler got no rows"
            vector = self._sum / self.num_positions
        else:
            assert self._row is not None, "the pooled row never came"
            vector = self._row
        if self.params.task == "score":
            return vector
        if self.params.dimensions is not None:
            vector = vector[: self.params.dimensions]
        if self.params.normalize is not False:  # None (unresolved) is the default: normalised
            vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
        return vector
