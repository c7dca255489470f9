"""Offline workloads of random token-id prompts: `tools/bench_throughput.py`'s and `pagoda bench throughput |
latency`'s. Random ids (not text) give exactly the prompt lengths asked for; outputs ignore EOS, so every run
computes the same number of tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """Token-id prompts and the number of tokens each request must generate."""

    prompts: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...]

    @property
    def num_requests(self) -> int:
        """Requests in the workload."""
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        """Tokens to generate over all requests."""
        return sum(self.output_lens)


def make_workload(
    num_requests: int,
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> Workload:
    """Uniformly random prompt lengths, output lengths and token ids (inclusive ranges), fixed by `seed`."""
    rng = random.Random(seed)
    prompts: list[tuple[int, ...]] = []
    lens: list[int] = []
    for _ in range(num_requests):
        prompts.append(tuple(rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_lens))))
        lens.append(rng.randint(*output_lens))
    return Workload(tuple(prompts), tuple(lens))


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's random dataset lengths: uniform in [length * (1 - ratio), length * (1 + ratio)], at least 1."""
    return max(1, round(length * (1.0 - range_ratio))), max(1, round(length * (1.0 + range_ratio)))
