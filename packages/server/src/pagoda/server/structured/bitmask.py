"""The grammar step of sampling: mask every constrained row's logits to the tokens its grammar allows next."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import xgrammar as xgr
from torch import Tensor


class GrammarBitmask:
    """Fills one packed bitmask row per constrained sample and applies it to the logits, in place.

    Runs before the Sampler, so that temperature, top-k, top-p and penalties only ever see allowed tokens;
    unconstrained rows are left untouched. The host bitmask buffer is reused across steps (grown on demand).
    """

    def __init__(self, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)  # what a finished grammar allows: the model's eos ids
        self._bitmask: Tensor = xgr.allocate_token_bitmask(0, vocab_size)  # int32 [rows, ceil(vocab / 32)]

    def apply(
        self,
        logits: Tensor,  # [num_rows, vocab], edited in place
        matchers: Sequence[xgr.GrammarMatcher | None],  # one per row; None: unconstrained
    ) -> None:
        """Mask the constrained rows; a grammar that already accepted its stop token allows only stop ids."""
        rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return
        if self._bitmask.shape[0] < len(matchers):
            self._bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        bitmask = self._bitmask[: len(matchers)]
        for i in rows:
            matcher = matchers[i]
            assert matcher is not None
            if matcher.is_terminated():
                # xgrammar refuses to fill a terminated matcher's mask: allow the stop ids by hand.
                bitmask[i].zero_()
                for token in self.stop_token_ids:
                    if token < self.vocab_size:
                        bit = 1 << (token % 32)
                        bitmask[i, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 bits
            else:
                matcher.fill_next_token_bitmask(bitmask, i)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        width = min(logits.shape[1], self.vocab_size)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows)
        if logits.shape[1] > width:  # logits padded past the grammar's vocabulary: never a valid token
            logits[torch.tensor(rows, device=logits.device), width:] = float("-inf")
