"""The engine's per-request bookkeeping: what the scheduler does not track (text, RNG seed, logprobs, timings).

`RequestState` is the plain request: the sampler draws every row of its n samples (`SamplesTokens`), and it
scores its prompt when asked to (`ScoresPrompt`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.scheduler import Request, Scheduler, sample_id
from pagoda.server.handoff import Resume
from pagoda.server.outputs import (
    CompletionOutput,
    FinishReason,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagoda.server.request_contract import DrawSpec
from pagoda.server.sampling import IncrementalDetokenizer, SamplingRow, TokenLogprobs
from pagoda.server.sampling.logits_processors import LogitsEdits, PreparedEdits, tokenize_bad_words
from pagoda.server.sampling_params import SamplingParams
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:  # xgrammar takes ~0.4 s to import: loaded at the first constrained request, not at start
    import xgrammar as xgr


@dataclass(frozen=True, slots=True)
class SchedulerParams:
    """The slice of SamplingParams the scheduler reads; eos is folded into stop_token_ids unless ignored."""

    max_tokens: int
    min_tokens: int
    n: int
    stop_token_ids: tuple[int, ...]  # sorted
    priority: int

    @classmethod
    def from_params(cls, params: SamplingParams, eos_token_ids: frozenset[int]) -> SchedulerParams:
        """Derive from the user's parameters and the model's eos ids."""
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        # A beam search holds beam_width sequences (the prompt forks into all of them) whatever n it returns.
        n = params.num_sequences
        return cls(params.max_tokens, params.min_tokens, n, tuple(sorted(stops)), params.priority)


@dataclass(slots=True)
class SampleState:
    """One of a request's n samples: its detokenizer, logprobs and finish."""

    index: int
    detokenizer: IncrementalDetokenizer
    include_stop_str: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    matcher: xgr.GrammarMatcher | None = None  # the sample's grammar state (structured outputs only)

    def accept(self, token_id: int) -> None:
        """Advance the grammar by a sampled token (once per token: a recompute replays no sampling)."""
        # A rejected token can only be one min_tokens forced past a grammar that allowed nothing but eos: the
        # matcher stays where it was, still allowing eos.
        if self.matcher is not None and not self.matcher.is_terminated():
            self.matcher.accept_token(token_id)

    def position_logprobs(self, token_id: int, logprobs: TokenLogprobs) -> PositionLogprobs:
        """One position's entry: the token's logprob and the top alternatives, with their texts."""
        decode = self.detokenizer.decode_token
        entry = {token_id: Logprob(logprobs.logprob, logprobs.rank, decode(token_id))}
        for rank, (tid, lp) in enumerate(zip(logprobs.top_token_ids, logprobs.top_logprobs, strict=True), 1):
            entry.setdefault(tid, Logprob(lp, rank, decode(tid)))
        return entry

    def add(self, token_id: int, logprobs: TokenLogprobs | None, *, is_stop_token: bool) -> str | None:
        """Record a sampled token; return the stop string it completes, if any.

        A stop token's text stays out of the output unless include_stop_str_in_output (vLLM's behaviour).
        """
        self.token_ids.append(token_id)
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(self.position_logprobs(token_id, logprobs))
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + logprobs.logprob
        if is_stop_token and not self.include_stop_str:
            return None
        return self.detokenizer.add_tokens([token_id])

    def snapshot(self) -> CompletionOutput:
        """An immutable copy of everything generated so far."""
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.output_text(self.finish_reason is not None),
            token_ids=tuple(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class RequestState:
    """A user request: prompt, parameters, timings, and its samples keyed by scheduler sequence id."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: tuple[int, ...],
        params: SamplingParams,
        stop_token_ids: tuple[int, ...],
        tokenizer: PreTrainedTokenizerBase,
        arrival_time: float,
        seed: int,
    ) -> None:
        """`stop_token_ids` includes eos unless ignored (SchedulerParams.stop_token_ids); `seed` keys the
        samples' draws: params.seed, or one the engine derives for an unseeded request."""
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seed = seed
        # Stop ids incl. eos: the sampler masks them while the output is shorter than min_tokens.
        self.stop_token_ids = stop_token_ids
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        # The API tokenizes bad words at admission, on its tokenizer threads; offline callers get it done here.
        bad_words = params.bad_words_token_ids
        if bad_words is None:
            bad_words = tokenize_bad_words(tokenizer, params.bad_words or ())
        self.bad_words_token_ids = bad_words
        # Masks and bias tensors built once for the request and all its samples, not per row per step.
        self.prepared_edits = PreparedEdits(params.logit_bias, params.allowed_token_ids, bad_words)
        # Entry p is prompt position p's; the first token has no context, so no logprobs (None).
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            None if params.prompt_logprobs is None else [None]
        )
        # Keyed by the scheduler's sequence ids: sample 0 runs under the request's own id.
        self.samples: dict[str, SampleState] = {
            sample_id(request_id, index): SampleState(
                index=index,
                detokenizer=IncrementalDetokenizer(tokenizer, prompt_token_ids, params),
                include_stop_str=params.include_stop_str_in_output,
                logprobs=None if params.logprobs is None else [],
                cumulative_logprob=None if params.logprobs is None else 0.0,
            )
            for index in range(params.n)
        }
        self.seq_ids = tuple(self.samples)  # fixed: the scheduler forks all n samples at the first step

    def start_grammar(self, compiled: xgr.CompiledGrammar) -> None:
        """Give every sample its own matcher of the compiled grammar (n > 1 samples diverge)."""
        import xgrammar as xgr  # loaded by the grammar's compile already

        for sample in self.samples.values():
            sample.matcher = xgr.GrammarMatcher(compiled)
            for token_id in sample.token_ids:  # a resumed sample's outputs so far (`resume`)
                sample.accept(token_id)

    def resume(self, resume: Resume) -> None:
        """Take on sample 0's outputs so far from another engine (prefill/decode disaggregation): they extend
        its text, logprobs and grammar as if drawn here (their stop rules were checked where they were drawn)."""
        sample = self.samples[self.request_id]
        sample.token_ids.extend(resume.output_token_ids)
        sample.detokenizer.add_tokens(resume.output_token_ids)
        if sample.logprobs is not None and resume.logprobs is not None:
            sample.logprobs.extend(resume.logprobs)
            sample.cumulative_logprob = resume.cumulative_logprob

    def mark_scheduled(self, num_cached_tokens: int, now: float) -> None:
        """Note the first step that schedules the request; admission starts it at its prefix-cache hit."""
        if self.metrics.first_scheduled_time is None:
            self.num_cached_tokens = num_cached_tokens
            self.touch(first_scheduled_time=now)

    def sampling_row(self, seq_id: str) -> SamplingRow:
        """What the sampler needs to draw the next token of sample `seq_id`."""
        sample = self.samples[seq_id]
        return SamplingRow(
            params=self.params,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=sample.token_ids,
            seed=self.seed,
            sample_index=sample.index,
            stop_token_ids=self.stop_token_ids,
        )

    def draw_spec(self, seq_id: str) -> DrawSpec:
        """Every row of a plain request is drawn by the sampler."""
        return DrawSpec(self.sampling_row(seq_id), self.logits_edits(seq_id), self.samples[seq_id].matcher)

    def logits_edits(self, seq_id: str) -> LogitsEdits:
        """What the logits processors do to sample `seq_id`'s next-token logits."""
        return LogitsEdits(
            logit_bias=self.params.logit_bias,
            allowed_token_ids=self.params.allowed_token_ids,
            bad_words_token_ids=self.bad_words_token_ids,
            output_token_ids=self.samples[seq_id].token_ids,
            prepared=self.prepared_edits,
        )

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while some prompt position's logprobs are still to be computed."""
        entries = self.prompt_logprobs
        return entries is not None and len(entries) < len(self.prompt_token_ids)

    @property
    def prompt_logprobs_k(self) -> int | None:
        """Top-k of the prompt logprobs still to compute (0: the prompt token's own only); None: none are."""
        return (self.params.prompt_logprobs or 0) if self.wants_prompt_logprobs else None

    def add_prompt_logprobs(self, start: int, logprobs: list[TokenLogprobs]) -> None:
        """Record the logprobs of the prompt tokens after positions start, start + 1, ... (the logits at position
        p score prompt token p + 1); positions already recorded (a recomputation after preemption) are skipped."""
        entries = self.prompt_logprobs
        if entries is None:
            return
        first = next(iter(self.samples.values()))
        for p, lp in enumerate(logprobs, start):
            if p + 1 == len(entries):
                entries.append(first.position_logprobs(self.prompt_token_ids[p + 1], lp))

    def add_token(self, seq_id: str, token_id: int, logprobs: TokenLogprobs | None, now: float) -> str | None:
        """Record sample `seq_id`'s new token at time `now`; return the stop string it completes, if any."""
        sample = self.samples[seq_id]
        # The scheduler stops on it once the output, this token included, reaches min_tokens.
        is_stop = token_id in self.stop_token_ids and len(sample.token_ids) + 1 >= self.params.min_tokens
        self.touch(first_token_time=now, last_token_time=now)
        sample.accept(token_id)
        return sample.add(token_id, logprobs, is_stop_token=is_stop)

    @property
    def finished(self) -> bool:
        """True once every sample has finished."""
        return all(s.finish_reason is not None for s in self.samples.values())

    def finish(self, seq_id: str, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """Mark one sample finished (the first reason wins)."""
        sample = self.samples[seq_id]
        if sample.finish_reason is None:
            sample.finish_reason = reason
            sample.stop_reason = stop_reason
        if self.finished and self.metrics.finished_time is None:
            self.touch(finished_time=time.monotonic())

    def finish_as_scheduled(self, request: Request, stop_string: str | None) -> None:
        """Finish the sample the scheduler finished, for its reason (a stop string wins over a length cap)."""
        seq_id = request.request_id
        if stop_string is not None:
            self.finish(seq_id, "stop", stop_string)
        elif request.finish_reason == "stop":
            self.finish(seq_id, "stop", request.stop_token_id)
        else:
            self.finish(seq_id, "length")

    def end_step(self, scheduler: Scheduler) -> bool:
        """Nothing to rewrite: a step that gave it rows always changed its output."""
        return True

    def abort(self) -> RequestOutput:
        """Finish every sample as aborted (a finished sample keeps its reason); the final snapshot."""
        for seq_id in self.samples:
            self.finish(seq_id, "abort")
        return self.snapshot()

    def touch(self, **times: float) -> None:
        """Set metric timestamps (first_scheduled_time, first_token_time, ...) that are not set yet."""
        unset = {k: v for k, v in times.items() if k == "last_token_time" or getattr(self.metrics, k) is None}
        self.metrics = dataclasses.replace(self.metrics, **unset)

    def snapshot(self) -> RequestOutput:
        """The request's cumulative output now."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=tuple(s.snapshot() for s in self.samples.values()),
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=None if self.prompt_logprobs is None else tuple(self.prompt_logprobs),
        )
