"""The grammar step of sampling: mask every constrained row's logits to the tokens its grammar allows next."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from pagoda.pagedkernel.sampling.token_bitmask import apply_token_bitmask_
from torch import Tensor

if TYPE_CHECKING:  # xgrammar takes ~0.4 s to import: loaded at the first constrained request, not at start
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# Rows fill in parallel (xgrammar fills without the GIL): a row stuck in a slow fill holds one thread, the
# others keep filling the rest of the step.
_FILL_THREADS = 2
DEFAULT_FILL_TIMEOUT = 1.0  # seconds (the engine's --grammar-fill-timeout)


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> Tensor:  # int32 [num_rows, ceil(vocab / 32)]
    """xgrammar's bitmask buffer (every token allowed: all bits set), allocated without importing xgrammar."""
    return torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


@dataclass(frozen=True, slots=True)
class FilledBitmask:
    """One step's filled bitmask: the rows it masks, and the rows whose grammar could not be advanced."""

    bitmask: Tensor  # int32 [num_rows, ceil(vocab / 32)]: valid in `rows` only
    rows: tuple[int, ...]  # constrained rows, filled
    failed: tuple[int, ...]  # constrained rows whose fill raised or timed out (their requests are aborted)


@dataclass(frozen=True, slots=True)
class _StepFills:
    """The fills of one step: the buffer they write, the constrained rows, and each live row's fill."""

    bitmask: Tensor  # int32 [num_rows, ceil(vocab / 32)]
    rows: tuple[int, ...]
    fills: dict[int, Future[bool]]  # live row -> its fill on the pool

    def filled(self, late: Iterable[int] = (), *, log: bool = True) -> FilledBitmask:
        """The step's result: rows whose fill raised (logged unless not `log`), or that are `late`, are failed."""
        failed = set(late)
        for row, fill in self.fills.items():
            if row not in failed and fill.exception() is not None:
                if log:
                    logger.error("the grammar of row %d could not be filled", row, exc_info=fill.exception())
                failed.add(row)
        return FilledBitmask(
            self.bitmask, tuple(r for r in self.rows if r not in failed), tuple(sorted(failed))
        )


class GrammarBitmask:
    """Fills one packed bitmask row per constrained sample and applies it to the logits, in place.

    Runs before the Sampler, so that temperature, top-k, top-p and penalties only ever see allowed tokens;
    unconstrained rows are left untouched. The fill depends only on the grammar states, known once the previous
    step's tokens were accepted, so `start_fill` runs it on worker threads while the model computes the logits;
    `apply` joins it. Each row fills as its own task, and `apply` waits at most `fill_timeout` seconds: a row
    still filling then fails alone (its request is aborted with a logged reason) instead of stalling the step
    for everyone. The host bitmask buffer is reused across steps (grown on demand), and replaced after a step
    that left a fill running, whose late write must not land in a later step's mask.
    """

    def __init__(
        self, vocab_size: int, stop_token_ids: Iterable[int], fill_timeout: float = DEFAULT_FILL_TIMEOUT
    ) -> None:
        self.vocab_size = vocab_size
        self.fill_timeout = fill_timeout
        self._bitmask: Tensor = allocate_token_bitmask(0, vocab_size)  # int32 [rows, ceil(vocab / 32)]
        # What a finished grammar allows (xgrammar refuses to fill a terminated matcher): the model's eos ids.
        self._stop_row = allocate_token_bitmask(1, vocab_size)[0].zero_()  # int32 [ceil(vocab / 32)]
        for token in sorted(stop_token_ids):
            if token < vocab_size:
                bit = 1 << (token % 32)
                self._stop_row[token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 bits
        self._pool: ThreadPoolExecutor | None = None
        self._steps: dict[Future[FilledBitmask], _StepFills] = {}  # started, not applied yet

    def start_fill(self, matchers: Sequence[xgr.GrammarMatcher | None]) -> Future[FilledBitmask] | None:
        """Fill the step's bitmask on the worker threads (one matcher per row; None: unconstrained).

        None when no row is constrained. The matchers must not advance until `apply` has joined the fill.
        """
        if all(matcher is None for matcher in matchers):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_FILL_THREADS, thread_name_prefix="pagoda-bitmask")
        pool = self._pool
        bitmask = self._buffer(len(matchers))
        rows: list[int] = []
        live: list[tuple[int, xgr.GrammarMatcher]] = []
        for i, matcher in enumerate(matchers):
            if matcher is None:
                continue
            rows.append(i)
            if matcher.is_terminated():
                bitmask[i] = self._stop_row
            else:
                live.append((i, matcher))
        fills = {row: pool.submit(matcher.fill_next_token_bitmask, bitmask, row) for row, matcher in live}
        step = _StepFills(bitmask, tuple(rows), fills)
        done: Future[FilledBitmask] = Future()
        self._steps[done] = step
        _resolve_when_done(done, step)
        return done

    def fill(self, matchers: Sequence[xgr.GrammarMatcher | None]) -> FilledBitmask:
        """Fill one bitmask row per constrained row now (one matcher per row; None: unconstrained)."""
        pending = self.start_fill(matchers)
        if pending is None:
            return FilledBitmask(self._buffer(len(matchers)), (), ())
        return self._join(pending)

    def apply(
        self,
        logits: Tensor,  # [num_rows, vocab], edited in place
        filled: FilledBitmask | Future[FilledBitmask] | None,  # from `fill` or `start_fill`
    ) -> tuple[int, ...]:
        """Mask the filled rows (past the grammar's vocabulary too); the rows whose fill failed or timed out."""
        if filled is None:
            return ()
        if isinstance(filled, Future):
            filled = self._join(filled)
        if filled.rows:
            width = min(logits.shape[1], self.vocab_size)
            apply_token_bitmask_(logits, filled.bitmask, filled.rows, width)
        return filled.failed

    def _join(self, pending: Future[FilledBitmask]) -> FilledBitmask:
        """The step's fills, waiting at most `fill_timeout`: rows still filling then are failed."""
        step = self._steps.pop(pending, None)
        if step is None:  # not started here: only its result can tell
            return pending.result()
        wait(list(step.fills.values()), timeout=self.fill_timeout)
        late = [row for row, fill in step.fills.items() if not fill.done()]
        if not late:
            return step.filled()
        for row in late:
            logger.error(
                "the grammar of row %d did not fill its token mask within %g s (--grammar-fill-timeout): its "
                "request is aborted",
                row,
                self.fill_timeout,
            )
        # The late fills still write into this buffer: later steps get a new one.
        self._bitmask = allocate_token_bitmask(self._bitmask.shape[0], self.vocab_size)
        return step.filled(late)

    def _buffer(self, num_rows: int) -> Tensor:  # int32 [num_rows, ceil(vocab / 32)]
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = allocate_token_bitmask(num_rows, self.vocab_size)
        return self._bitmask[:num_rows]


def _resolve_when_done(done: Future[FilledBitmask], step: _StepFills) -> None:
    """Complete `done` with the step's result once every row's fill has ended (at once if none runs)."""
    remaining = len(step.fills)
    if not remaining:
        done.set_result(step.filled(log=False))
        return
    lock = threading.Lock()

    def one_ended(_: Future[bool]) -> None:
        nonlocal remaining
        with lock:
            remaining -= 1
            last = remaining == 0
        if last:  # `apply` logs the failures it reports
            done.set_result(step.filled(log=False))

    for fill in step.fills.values():
        fill.add_done_callback(one_ended)
