"""The fused sampling op: temperature, min_p, top_k, top_p and a counter-based Gumbel-max draw in one call.

    sampler = get_sampler("auto", device)            # cpu (C) on the CPU, triton on CUDA, torch anywhere
    params = SamplingTensors.build(temperature=[...], keys=[rng_key(seed, sample, position), ...], top_p=[...])
    out = sampler(logits, params, num_logprobs=[None, 5, ...])
    out.token_ids, out.status, out.logprobs

The torch backend (torch_sampling) is the specification; every backend returns bitwise the same tokens for the
same keys, whatever the batch and the thread count. See the package README's "Sampling" section.
"""

from pagoda.pagedkernel.sampling.params import (
    GREEDY_TEMPERATURE,
    Logprobs,
    SampleOutput,
    SampleStatus,
    SamplingError,
    SamplingTensors,
)
from pagoda.pagedkernel.sampling.rng import rng_key, rng_keys
from pagoda.pagedkernel.sampling.sampler import SAMPLER_NAMES, FusedSampler, SamplerBackend, get_sampler

__all__ = [
    "GREEDY_TEMPERATURE",
    "SAMPLER_NAMES",
    "FusedSampler",
    "Logprobs",
    "SampleOutput",
    "SampleStatus",
    "SamplerBackend",
    "SamplingError",
    "SamplingTensors",
    "get_sampler",
    "rng_key",
    "rng_keys",
]
