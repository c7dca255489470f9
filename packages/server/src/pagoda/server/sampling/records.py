"""The sampler's input rows and output records."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.pagedkernel.sampling import SampleStatus, rng_key
from pagoda.server.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One sample to draw this step: its parameters, token history, RNG seed and the ids min_tokens masks."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far for this sample
    # The request's seed, or for an unseeded request one the engine derives from its own seed (unseeded_seed).
    seed: int
    sample_index: int  # which of the request's n samples
    stop_token_ids: tuple[int, ...]  # masked while len(output_token_ids) < params.min_tokens

    def rng_key(self) -> int:
        """The op's RNG key of this draw: (seed, sample index, output position) hashed in turn."""
        return rng_key(self.seed, self.sample_index, len(self.output_token_ids))


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-softmax of the raw logits at one position: the sampled token's logprob and rank, and the top-k."""

    logprob: float
    rank: int  # 1-based rank of the sampled token (1 + number of tokens strictly more likely)
    top_token_ids: list[int]  # params.logprobs most likely ids, most likely first
    top_logprobs: list[float]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One sampled token per row, its logprobs where the row asked, and the rows that could not be sampled."""

    token_ids: list[int]  # 0 for a failed row
    logprobs: list[TokenLogprobs | None]
    # Row index -> why it failed (NaN / +inf logits, or every token masked); the engine fails those requests.
    failed: dict[int, SampleStatus]


def unseeded_seed(engine_seed: int, request_number: int) -> int:
    """The seed of the engine's `request_number`-th unseeded request: a hash of both (rng_key's first two steps),
    so `--seed` fixes every unseeded request's tokens for the same arrival order."""
    return rng_key(engine_seed, request_number, 0)
