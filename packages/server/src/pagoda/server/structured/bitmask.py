"""The grammar step of sampling: mask every constrained row's logits to the tokens its grammar allows next."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import xgrammar as xgr
from pagoda.pagedkernel.sampling.token_bitmask import apply_token_bitmask_
from torch import Tensor

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FilledBitmask:
    """One step's filled bitmask: the rows it masks, and the rows whose grammar could not be advanced."""

    bitmask: Tensor  # int32 [num_rows, ceil(vocab / 32)]: valid in `rows` only
    rows: tuple[int, ...]  # constrained rows, filled
    failed: tuple[int, ...]  # constrained rows whose fill raised (their requests are aborted, not sampled)


class GrammarBitmask:
    """Fills one packed bitmask row per constrained sample and applies it to the logits, in place.

    Runs before the Sampler, so that temperature, top-k, top-p and penalties only ever see allowed tokens;
    unconstrained rows are left untouched. The fill depends only on the grammar states, known once the previous
    step's tokens were accepted, so `start_fill` runs it on a worker thread while the model computes the logits
    (xgrammar fills without the GIL); `apply` joins it. The host bitmask buffer is reused across steps (grown on
    demand): a step's fill starts only after the previous step's apply.
    """

    def __init__(self, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self._bitmask: Tensor = xgr.allocate_token_bitmask(0, vocab_size)  # int32 [rows, ceil(vocab / 32)]
        # What a finished grammar allows (xgrammar refuses to fill a terminated matcher): the model's eos ids.
        self._stop_row = xgr.allocate_token_bitmask(1, vocab_size)[0].zero_()  # int32 [ceil(vocab / 32)]
        for token in sorted(stop_token_ids):
            if token < vocab_size:
                bit = 1 << (token % 32)
                self._stop_row[token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 bits
        # One fill call per step for all rows: a single GIL hand-off when it runs beside the forward.
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._pool: ThreadPoolExecutor | None = None

    def start_fill(self, matchers: Sequence[xgr.GrammarMatcher | None]) -> Future[FilledBitmask] | None:
        """Fill the step's bitmask on the worker thread (one matcher per row; None: unconstrained).

        None when no row is constrained. The matchers must not advance until `apply` has joined the fill.
        """
        if all(matcher is None for matcher in matchers):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagoda-bitmask")
        return self._pool.submit(self.fill, list(matchers))

    def fill(self, matchers: Sequence[xgr.GrammarMatcher | None]) -> FilledBitmask:
        """Fill one bitmask row per constrained row (one matcher per row; None: unconstrained)."""
        if self._bitmask.shape[0] < len(matchers):
            self._bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        bitmask = self._bitmask[: len(matchers)]
        live: list[xgr.GrammarMatcher] = []
        live_rows: list[int] = []
        rows: list[int] = []
        for i, matcher in enumerate(matchers):
            if matcher is None:
                continue
            rows.append(i)
            if matcher.is_terminated():
                bitmask[i] = self._stop_row
            else:
                live.append(matcher)
                live_rows.append(i)
        failed: list[int] = []
        if live:
            try:
                self._batch.batch_fill_next_token_bitmask(live, bitmask, live_rows)
            except Exception:  # find the rows that fail, one at a time; the others go on
                failed = self._fill_one_by_one(live, live_rows, bitmask)
        return FilledBitmask(bitmask, tuple(r for r in rows if r not in failed), tuple(failed))

    def apply(
        self,
        logits: Tensor,  # [num_rows, vocab], edited in place
        filled: FilledBitmask | Future[FilledBitmask] | None,  # from `fill` or `start_fill`
    ) -> tuple[int, ...]:
        """Mask the filled rows (past the grammar's vocabulary too); the rows whose fill failed."""
        if filled is None:
            return ()
        if isinstance(filled, Future):
            filled = filled.result()
        if filled.rows:
            width = min(logits.shape[1], self.vocab_size)
            apply_token_bitmask_(logits, filled.bitmask, filled.rows, width)
        return filled.failed

    @staticmethod
    def _fill_one_by_one(matchers: list[xgr.GrammarMatcher], rows: list[int], bitmask: Tensor) -> list[int]:
        """Fill row by row after the batched fill raised; the rows that raise again."""
        failed: list[int] = []
        for matcher, row in zip(matchers, rows, strict=True):
            try:
                matcher.fill_next_token_bitmask(bitmask, row)
            except Exception:  # the request fails, the step goes on
                logger.exception("the grammar of row %d could not be filled", row)
                failed.append(row)
        return failed
