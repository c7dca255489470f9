"""The sampler's input rows and output records, and the per-sample generator seeding rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pagoda.server.sampling_params import SamplingParams

_SEED_MODULUS = 2**64  # torch.Generator.manual_seed accepts any value in [0, 2**64)


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One sample to draw this step: its parameters, token history, own RNG and the ids min_tokens masks."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far for this sample
    generator: torch.Generator | None  # None: draw from the shared default RNG
    stop_token_ids: tuple[int, ...]  # masked while len(output_token_ids) < params.min_tokens


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-softmax of the raw logits at one position: the sampled token's logprob and rank, and the top-k."""

    logprob: float
    rank: int  # 1-based rank of the sampled token (1 + number of tokens strictly more likely)
    top_token_ids: list[int]  # params.logprobs most likely ids, most likely first
    top_logprobs: list[float]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One sampled token per row, and its logprobs where the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a request seeded with `seed` (vLLM's rule: seed + index)."""
    return (seed + sample_index) % _SEED_MODULUS


def make_generator(
    params: SamplingParams, sample_index: int, device: torch.device | str
) -> torch.Generator | None:
    """A generator for one sample of a seeded request, or None when the request has no seed.

    Sample i of a request with seed s draws from `torch.Generator(device).manual_seed(s + i)`, so sample 0 of
    a seeded request reproduces an n=1 request with the same seed, and the n samples differ from each other.
    """
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(sample_seed(params.seed, sample_index))
