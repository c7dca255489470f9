"""Batched sampling and incremental detokenization with stop strings."""

from pagoda.server.sampling.detokenizer import IncrementalDetokenizer
from pagoda.server.sampling.records import (
    SamplerOutput,
    SamplingRow,
    TokenLogprobs,
    unseeded_seed,
)
from pagoda.server.sampling.sampler import Sampler

__all__ = [
    "IncrementalDetokenizer",
    "Sampler",
    "SamplerOutput",
    "SamplingRow",
    "TokenLogprobs",
    "unseeded_seed",
]
