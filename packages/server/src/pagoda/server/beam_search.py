"""Beam search: the parameters, the results (vLLM's `BeamSearchParams` / `BeamSearchOutput` shapes), and the
policy of one beam group, step by step exactly as transformers' `generate(num_beams=k, do_sample=False)`.

Policy only: `BeamSearchPolicy.step` turns the log-probabilities of the k running beams into the next k beams
(each a parent beam and a token) and the finished hypotheses. Which sequence holds which KV blocks, forks and
frees is the engine's mechanism (engine/beams.py over the scheduler's held sequences).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

EarlyStopping = bool | Literal["never"]
# transformers' stand-in for minus infinity in beam scores (finite so that sums and divisions stay finite).
_NEG = -1.0e9


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """Beam search for one prompt: `beam_width` beams, scored as cumulative logprob / length**length_penalty."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    # True: stop once beam_width hypotheses finished; False: also stop when no running beam can beat the worst
    # finished one at its current length; "never": only when none could at max_tokens (transformers' meanings).
    early_stopping: EarlyStopping = False

    def __post_init__(self) -> None:
        """ValueError naming the field on an out-of-range value."""
        if self.beam_width < 1:
            raise ValueError("beam_width must be at least 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError('early_stopping must be true, false or "never"')


@dataclass(frozen=True, slots=True)
class BeamSearchSequence:
    """One finished beam: generated token ids (the eos that ended it included), its text and scores."""

    tokens: tuple[int, ...]
    text: str
    cum_logprob: float  # sum of the tokens' log-probabilities
    score: float  # cum_logprob / len(tokens) ** length_penalty: transformers' `sequences_scores`
    finish_reason: Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best score first."""

    sequences: tuple[BeamSearchSequence, ...]


@dataclass(frozen=True, slots=True)
class BeamStep:
    """What one step decided: the next running beams and whether the search is over."""

    parents: tuple[int, ...]  # per next running beam: the index of the running beam it extends
    tokens: tuple[int, ...]  # per next running beam: its new token
    done: bool


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """A finished candidate: generated tokens, raw cumulative logprob and length-penalized score."""

    tokens: tuple[int, ...]
    cum_logprob: float
    score: float


class BeamSearchPolicy:
    """transformers' beam search for one prompt (batch size 1): 2k candidates per step (more with several eos
    ids), the k best unfinished ones run on, the best of the k top candidates that finish join k hypotheses."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: frozenset[int]) -> None:
        """Start with one real beam (the others score -1e9, so the first step extends beam 0 only)."""
        self.params = params
        self.eos = torch.tensor(sorted(() if params.ignore_eos else eos_token_ids), dtype=torch.int64)
        k = params.beam_width
        self.num_candidates = max(2, 1 + self.eos.numel()) * k
        self.running_scores = torch.full((k,), _NEG)
        self.running_scores[0] = 0.0
        self.running_tokens: list[tuple[int, ...]] = [()] * k
        self.finished_scores = torch.full((k,), _NEG)
        self.finished_raw = torch.full((k,), _NEG)
        self.finished_tokens: list[tuple[int, ...]] = [()] * k
        self.is_finished = torch.zeros(k, dtype=torch.bool)
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.num_generated = 0

    def step(
        self,
        logprobs: Tensor,  # float32 [beam_width, vocab]: log_softmax of each running beam's next-token logits
    ) -> BeamStep:
        """Advance every beam by one token; see transformers' `_beam_search` (steps c to g)."""
        k, p = self.params.beam_width, self.params
        vocab = logprobs.shape[-1]
        accumulated = (logprobs + self.running_scores[:, None]).reshape(-1)
        top_scores, top_indices = torch.topk(accumulated, k=self.num_candidates)
        beams = (top_indices // vocab).tolist()
        tokens = (top_indices % vocab).tolist()
        length = self.num_generated + 1
        hits = torch.isin(top_indices % vocab, self.eos) | (length >= p.max_tokens)
        # The next running beams: the k best candidates that did not just finish.
        running = top_scores + hits.to(torch.float32) * _NEG
        next_indices = torch.topk(running, k=k)[1].tolist()
        # Hypotheses: only the k top candidates may finish; merged with the previous ones, the k best stay.
        penalized = top_scores / (length**p.length_penalty)
        # Two separate additions, as transformers makes them (the sums decide ties among discarded entries).
        full = bool(self.is_finished.all()) and p.early_stopping is True
        penalized = penalized + float(full) * _NEG
        penalized = penalized + float(not self.improvable) * _NEG
        just_finished = hits & (torch.arange(self.num_candidates) < k)
        penalized = penalized + (~just_finished) * _NEG
        candidate_tokens = [self.running_tokens[b] + (t,) for b, t in zip(beams, tokens, strict=True)]
        merged = torch.cat((self.finished_scores, penalized))
        merged_raw = torch.cat((self.finished_raw, top_scores))
        merged_tokens = self.finished_tokens + candidate_tokens
        merged_done = torch.cat((self.is_finished, just_finished))
        keep = torch.topk(merged, k=k)[1]
        self.finished_scores, self.finished_raw = merged[keep], merged_raw[keep]
        self.is_finished = merged_done[keep]
        self.finished_tokens = [merged_tokens[i] for i in keep.tolist()]
        self.running_scores = running[next_indices]
        self.running_tokens = [candidate_tokens[i] for i in next_indices]
        self.num_generated = length
        self._update_improvable()
        all_finished = bool(self.is_finished.all())
        done = not self.improvable or (all_finished and p.early_stopping is True) or bool(hits.all())
        return BeamStep(
            parents=tuple(beams[i] for i in next_indices),
            tokens=tuple(tokens[i] for i in next_indices),
            done=done,
        )

    def _update_improvable(self) -> None:
        """Whether the best running beam could still beat the worst hypothesis (transformers' heuristic)."""
        p = self.params
        if p.early_stopping == "never" and p.length_penalty > 0.0:
            best_length = p.max_tokens
        else:
            best_length = self.num_generated
        best_running = self.running_scores[0] / (best_length**p.length_penalty)
        worst = torch.where(self.is_finished, self.finished_scores.min(), torch.tensor(_NEG))
        self.improvable = self.improvable and bool((best_running > worst).any())

    def hypotheses(self) -> list[Hypothesis]:
        """The k hypotheses, best score first."""
        return [
            Hypothesis(tokens, raw, score)
            for tokens, raw, score in zip(
                self.finished_tokens, self.finished_raw.tolist(), self.finished_scores.tolist(), strict=True
            )
        ]


def finish_reason(
    tokens: Sequence[int], eos_token_ids: frozenset[int], ignore_eos: bool
) -> Literal["stop", "length"]:
    """ "stop" when a hypothesis ended on an eos token, else "length"."""
    return "stop" if tokens and not ignore_eos and tokens[-1] in eos_token_ids else "length"
