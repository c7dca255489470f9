"""One step's sampling: every row of the step goes to its request, drawn by the sampler or as log-probabilities.

A row's request says which by its capability (`pagoda.server.request_contract`, resolved once in the engine's
`RequestOwners`): a `SamplesTokens` request's row is drawn as its `draw_spec` says (grammar mask, logits
processors, the sampling op); a `TakesLogprobRows` request is handed the row's float32 log-softmax and its
sequence is held. A chunk with draft tokens has one row per drafted position, and its sequence gets the accepted
run of tokens (`pagoda.server.spec.verify`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from pagoda.pagedkernel.sampling import SampleOutput, SamplingTensors
from pagoda.scheduler import SchedulerOutput
from pagoda.server.engine.owners import RequestOwners
from pagoda.server.engine.sample_failures import SampleFailures
from pagoda.server.request_contract import DrawSpec, EngineRequest, TakesLogprobRows
from pagoda.server.sampling import Sampler, TokenLogprobs
from pagoda.server.sampling.logits_processors import apply_logits_processors
from pagoda.server.sampling.logprobs import compute_logprobs
from pagoda.server.sampling.penalties import needs_history
from pagoda.server.spec.verify import DraftGroup, draft_row_specs, num_accepted, rejection_sample
from pagoda.server.structured import FilledBitmask, GrammarBitmask

# A sequence's scheduled drafts -> the draft model's q at each (float32 [k, vocab]); None: point masses.
DraftProbs = Callable[[str, Sequence[int]], torch.Tensor | None]


@dataclass(frozen=True, slots=True)
class StepRows:
    """The step's sample rows in schedule order (one per sample id), with the drawn rows' masks filling."""

    seq_ids: tuple[str, ...]
    owners: tuple[EngineRequest, ...]
    specs: tuple[DrawSpec | None, ...]  # None: the row is handed over (its request takes logprob rows)
    grammar: Future[FilledBitmask] | None  # masks of the drawn rows, in order (None: no constrained row)
    row_takers: Mapping[str, TakesLogprobRows]  # the owners of the handed-over rows, by sequence id
    drafts: tuple[DraftGroup, ...] = ()  # the drafted chunks' rows (speculative decoding)


@dataclass(frozen=True, slots=True)
class SampledStep:
    """What the step's rows gave: drawn (sequence id, token id, logprobs), held sequence ids, failed requests."""

    drawn: tuple[tuple[str, int, TokenLogprobs | None], ...]
    held: tuple[str, ...]  # sequences whose request took the row's log-probabilities (no token appended)
    failures: SampleFailures
    # (drafts, accepted) of each drafted chunk whose request did not fail, for the spec-decode metrics.
    verified: tuple[tuple[int, int], ...] = ()

    @property
    def has_runs(self) -> bool:
        """Whether a sequence may have drawn a run of several tokens (a stop rule may end it mid-run)."""
        return bool(self.verified)


class StepSampler:
    """Plans a step's rows before the forward pass (so grammar masks fill meanwhile), then samples them."""

    def __init__(
        self, sampler: Sampler, grammar_bitmask: GrammarBitmask, draft_probs: DraftProbs | None = None
    ) -> None:
        """`draft_probs`: the draft model's q of a drafted chunk (method draft_model), so that sampled drafts are
        verified by rejection sampling against it; None: drafts are point masses."""
        self.sampler = sampler
        self.grammar_bitmask = grammar_bitmask
        self.draft_probs = draft_probs

    def plan(self, scheduled: SchedulerOutput, owners: RequestOwners) -> StepRows:
        """Each row's owner and draw spec; the grammar masks depend only on tokens accepted so far: start them."""
        if scheduled.scheduled_spec_decode_tokens:
            return self._plan_drafted(scheduled, owners)
        seq_ids = tuple(seq_id for chunk in scheduled.scheduled for seq_id in chunk.sample_ids)
        row_owners = tuple(owners.seqs[seq_id] for seq_id in seq_ids)
        samplers = owners.samplers
        specs = tuple(
            None if (sampled := samplers.get(seq_id)) is None else sampled.draw_spec(seq_id)
            for seq_id in seq_ids
        )
        grammar = self.grammar_bitmask.start_fill([spec.matcher for spec in specs if spec is not None])
        return StepRows(seq_ids, row_owners, specs, grammar, owners.row_takers)

    def _plan_drafted(self, scheduled: SchedulerOutput, owners: RequestOwners) -> StepRows:
        """`plan` for a step with drafted chunks: k + 1 rows for each, one per position."""
        seq_ids: list[str] = []
        specs: list[DrawSpec | None] = []
        groups: list[DraftGroup] = []
        for chunk in scheduled.scheduled:
            drafts = chunk.spec_token_ids
            for seq_id in chunk.sample_ids:
                sampled = owners.samplers.get(seq_id)
                spec = None if sampled is None else sampled.draw_spec(seq_id)
                if not drafts:
                    seq_ids.append(seq_id)
                    specs.append(spec)
                    continue
                if spec is None:
                    raise ValueError(f"sequence {seq_id!r} has drafts but takes log-probability rows")
                probs = None if self.draft_probs is None else self.draft_probs(seq_id, drafts)
                groups.append(DraftGroup(len(seq_ids), seq_id, drafts, probs))
                seq_ids += [seq_id] * (len(drafts) + 1)
                specs += draft_row_specs(spec, drafts)
        row_owners = tuple(owners.seqs[seq_id] for seq_id in seq_ids)
        grammar = self.grammar_bitmask.start_fill([spec.matcher for spec in specs if spec is not None])
        return StepRows(tuple(seq_ids), row_owners, tuple(specs), grammar, owners.row_takers, tuple(groups))

    @staticmethod
    def token_only(rows: StepRows) -> SamplingTensors | None:
        """The op's parameters of the step's rows when every row only needs a token from the plain op (no held
        rows, drafts, grammar, logits processors, penalties, logprobs or min_p): what the model's
        fused LM head draws (`Executor.execute_sampled`); None otherwise."""
        if rows.drafts or rows.grammar is not None or not rows.specs:
            return None
        specs = [spec for spec in rows.specs if spec is not None]
        if len(specs) != len(rows.specs):
            return None
        for spec in specs:
            p = spec.row.params
            if spec.matcher is not None or not spec.edits.empty or p.logprobs is not None:
                return None
            if p.min_p > 0.0:
                return None
        sampling_rows = [spec.row for spec in specs]
        if needs_history(sampling_rows):
            return None
        return SamplingTensors.build(
            temperature=[row.params.temperature for row in sampling_rows],
            keys=[row.rng_key() for row in sampling_rows],
            top_k=[row.params.top_k for row in sampling_rows],
            top_p=[row.params.top_p for row in sampling_rows],
        )

    @staticmethod
    def sampled(rows: StepRows, out: SampleOutput) -> SampledStep:
        """The step of `token_only` rows whose tokens the model drew (`out`: one per row, in order)."""
        failures = SampleFailures()
        failed = out.failed_rows()
        failures.add_sample_failures(failed, list(rows.seq_ids), list(rows.owners))
        drawn = tuple(
            (seq_id, token, None)
            for seq_id, token, owner in zip(rows.seq_ids, out.token_ids.tolist(), rows.owners, strict=True)
            if owner.request_id not in failures
        )
        return SampledStep(drawn, (), failures)

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
        entries: list[tuple[str, int, TokenLogprobs | None] | None] = list(
            zip(seq_ids, out.token_ids, out.logprobs, strict=True)
        )
        verified: list[tuple[int, int]] = []
        if any(group.probs is not None for group in rows.drafts):
            self._rejection_sample(rows, drawn_rows, processed, logits, specs, entries, out.failed)
        if rows.drafts:
            entries, verified = self._accepted_runs(rows, drawn_rows, entries, failures)
        drawn = tuple(
            entry
            for entry, owner in zip(entries, owners, strict=True)
            if entry is not None and owner.request_id not in failures
        )
        return SampledStep(drawn, held, failures, tuple(verified))

    def _rejection_sample(
        self,
        rows: StepRows,
        drawn_rows: list[int],
        processed: torch.Tensor,  # [num_drawn_rows, vocab]: what the sampler drew from
        raw: torch.Tensor,  # [num_drawn_rows, vocab]: the raw logits (logprobs are of these)
        specs: list[DrawSpec],
        entries: list[tuple[str, int, TokenLogprobs | None] | None],
        failed: Mapping[int, object],
    ) -> None:
        """Replace each draft-model chunk's drawn tokens by the rejection-sampled run (in `entries`), with the
        logprobs of the tokens that changed."""
        local = {row: i for i, row in enumerate(drawn_rows)}
        for group in rows.drafts:
            first, k = local[group.first_row], len(group.drafts)
            span = range(first, first + k + 1)
            if group.probs is None or any(i in failed for i in span):
                continue
            row_specs = [specs[i].row for i in span]
            p = self.sampler.probabilities(processed[first : first + k + 1], row_specs)
            drawn = [entry[1] if entry is not None else 0 for entry in entries[first : first + k + 1]]
            keys = [row.rng_key() for row in row_specs]
            chosen = rejection_sample(p, group.probs.to(p.device), group.drafts, keys, drawn)
            changed = [j for j in range(k + 1) if chosen[j] != drawn[j]]
            if not changed:
                continue
            index = torch.tensor([first + j for j in changed], dtype=torch.int64, device=raw.device)
            tokens = torch.tensor([chosen[j] for j in changed], dtype=torch.int64, device=raw.device)
            logprobs = compute_logprobs(
                raw.index_select(0, index), tokens, [row_specs[j].params.logprobs for j in changed]
            )
            for j, logprob in zip(changed, logprobs, strict=True):
                entries[first + j] = (group.seq_id, chosen[j], logprob)

    @staticmethod
    def _accepted_runs(
        rows: StepRows,
        drawn_rows: list[int],
        entries: list[tuple[str, int, TokenLogprobs | None] | None],
        failures: SampleFailures,
    ) -> tuple[list[tuple[str, int, TokenLogprobs | None] | None], list[tuple[int, int]]]:
        """Each drafted chunk's entries cut to its accepted run (None in place of the rest); (k, accepted) each.

        `entries` are the drawn rows' (`drawn_rows`, step row indices); a drafted chunk's rows are all drawn.
        """
        kept: list[tuple[str, int, TokenLogprobs | None] | None] = list(entries)
        verified: list[tuple[int, int]] = []
        local = {row: i for i, row in enumerate(drawn_rows)}
        for group in rows.drafts:
            first, k = local[group.first_row], len(group.drafts)
            drawn = [entry[1] for entry in entries[first : first + k + 1] if entry is not None]
            accepted = num_accepted(group.drafts, drawn)
            kept[first + accepted + 1 : first + k + 1] = [None] * (k - accepted)
            if rows.owners[group.first_row].request_id not in failures:
                verified.append((k, accepted))
        return kept, verified

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
            seq_id = rows.seq_ids[row]
            rows.row_takers[seq_id].add_logprob_row(seq_id, logprob)
        held = set(held_rows)
        others = [i for i in range(len(rows.seq_ids)) if i not in held]
        return logits.index_select(0, torch.tensor(others, dtype=torch.int64, device=logits.device))
