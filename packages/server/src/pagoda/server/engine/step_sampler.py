"""One step's sampling: every row of the step goes to its request, drawn by the sampler or as log-probabilities.

A row's request says which through its `draw_spec` (see `EngineRequest`): a spec is drawn (grammar mask, logits
processors, the sampling op), None hands the request the row's float32 log-softmax and holds the sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from pagoda.scheduler import SchedulerOutput
from pagoda.server.engine.engine_request import DrawSpec, EngineRequest
from pagoda.server.engine.sample_failures import SampleFailures
from pagoda.server.sampling import Sampler, TokenLogprobs
from pagoda.server.sampling.logits_processors import apply_logits_processors
from pagoda.server.structured import FilledBitmask, GrammarBitmask


@dataclass(frozen=True, slots=True)
class StepRows:
    """The step's sample rows in schedule order (one per sample id), with the drawn rows' masks filling."""

    seq_ids: tuple[str, ...]
    owners: tuple[EngineRequest, ...]
    specs: tuple[DrawSpec | None, ...]
    grammar: Future[FilledBitmask] | None  # masks of the drawn rows, in order (None: no constrained row)


@dataclass(frozen=True, slots=True)
class SampledStep:
    """What the step's rows gave: drawn (sequence id, token id, logprobs), held sequence ids, failed requests."""

    drawn: tuple[tuple[str, int, TokenLogprobs | None], ...]
    held: tuple[str, ...]  # sequences whose request took the row's log-probabilities (no token appended)
    failures: SampleFailures


class StepSampler:
    """Plans a step's rows before the forward pass (so grammar masks fill meanwhile), then samples them."""

    def __init__(self, sampler: Sampler, grammar_bitmask: GrammarBitmask) -> None:
        self.sampler = sampler
        self.grammar_bitmask = grammar_bitmask

    def plan(self, scheduled: SchedulerOutput, owners: Mapping[str, EngineRequest]) -> StepRows:
        """Each row's owner and draw spec; the grammar masks depend only on tokens accepted so far: start them."""
        seq_ids = tuple(seq_id for chunk in scheduled.scheduled for seq_id in chunk.sample_ids)
        row_owners = tuple(owners[seq_id] for seq_id in seq_ids)
        specs = tuple(owner.draw_spec(seq_id) for owner, seq_id in zip(row_owners, seq_ids, strict=True))
        grammar = self.grammar_bitmask.start_fill([spec.matcher for spec in specs if spec is not None])
        return StepRows(seq_ids, row_owners, specs, grammar)

    def sample(
        self,
        rows: StepRows,
        logits: torch.Tensor,  # [num_rows, vocab]: one row per sample id of the step, in schedule order
    ) -> SampledStep:
        """Hand over the log-probability rows, draw the others; requests whose row failed are logged, not sampled."""
        failures = SampleFailures()
        held_rows = [i for i, spec in enumerate(rows.specs) if spec is None]
        if held_rows:
            logits = self._hand_over(rows, logits, held_rows)
        held = tuple(rows.seq_ids[i] for i in held_rows)
        drawn_rows = [i for i, spec in enumerate(rows.specs) if spec is not None]
        if not drawn_rows:
            return SampledStep((), held, failures)
        seq_ids = [rows.seq_ids[i] for i in drawn_rows]
        owners = [rows.owners[i] for i in drawn_rows]
        specs = [spec for spec in rows.specs if spec is not None]
        # The grammar step comes first, so that penalties, temperature, top-k and top-p see only allowed tokens.
        grammar_failed = self.grammar_bitmask.apply(logits, rows.grammar)
        # logit_bias, allowed_token_ids and bad_words edit a copy; logprobs stay those of the raw logits.
        processed = apply_logits_processors(logits, [spec.edits for spec in specs])
        out = self.sampler(
            processed, [spec.row for spec in specs], raw_logits=None if processed is logits else logits
        )
        failures.add_grammar_failures(grammar_failed, seq_ids, owners)
        failures.add_sample_failures(out.failed, seq_ids, owners)
        drawn = tuple(
            entry
            for entry, owner in zip(
                zip(seq_ids, out.token_ids, out.logprobs, strict=True), owners, strict=True
            )
            if owner.request_id not in failures
        )
        return SampledStep(drawn, held, failures)

    @staticmethod
    def _hand_over(
        rows: StepRows,
        logits: torch.Tensor,  # [num_rows, vocab]
        held_rows: list[int],
    ) -> torch.Tensor:  # [num_drawn_rows, vocab]: the other rows' logits
        """Give the held rows' requests their log-probabilities (float32, as transformers scores beams)."""
        index = torch.tensor(held_rows, dtype=torch.int64, device=logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1).cpu()
        for row, logprob in zip(held_rows, logprobs, strict=True):
            rows.owners[row].add_logprob_row(rows.seq_ids[row], logprob)
        held = set(held_rows)
        others = [i for i in range(len(rows.seq_ids)) if i not in held]
        return logits.index_select(0, torch.tensor(others, dtype=torch.int64, device=logits.device))
