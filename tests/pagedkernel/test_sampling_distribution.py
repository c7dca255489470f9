"""The draws follow the exact distribution: chi-square tests over many draws on a small vocabulary, for temperature,
top_k, top_p, min_p and their combinations. Keys are fixed, so every run draws the same tokens (deterministic)."""

from __future__ import annotations

import pytest
import torch
from pagoda.pagedkernel.sampling import SamplingTensors, get_sampler, rng_key
from pagoda.pagedkernel.sampling.testing import exact_probabilities, sorted_kept_mask

DRAWS = 40_000
LOGITS = torch.tensor([2.0, 1.5, 1.5, 0.7, 0.0, -0.4, -1.0, -2.5, float("-inf"), -6.0])
# (temperature, top_k, top_p, min_p)
CASES = [
    (1.0, 0, 1.0, 0.0),
    (0.5, 0, 1.0, 0.0),
    (2.0, 0, 1.0, 0.0),
    (1.0, 3, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.7, 5, 0.9, 0.0),
    (1.3, 6, 0.95, 0.05),
    (1.0, 0, 0.6, 0.3),
]


def _p_value(statistic: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (the regularized upper incomplete gamma function)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_draws_match_the_exact_probabilities(case: tuple[float, int, float, float], backend: str) -> None:
    """Counts of 40,000 draws (one row each, keys from 40,000 positions) against softmax(x / T) over the kept set."""
    temperature, top_k, top_p, min_p = case
    params = SamplingTensors.build(
        temperature=[temperature] * DRAWS,
        keys=[rng_key(2024, 0, position) for position in range(DRAWS)],
        top_k=[top_k] * DRAWS,
        top_p=[top_p] * DRAWS,
        min_p=[min_p] * DRAWS,
    )
    out = get_sampler(backend)(LOGITS.expand(DRAWS, -1), params)
    assert out.failed_rows() == {}
    counts = torch.bincount(out.token_ids, minlength=LOGITS.numel()).to(torch.float64)
    x = LOGITS * params.inverse_temperature()[0]
    kept = sorted_kept_mask(x, top_k, top_p, min_p)
    assert float(counts[~kept].sum()) == 0.0  # a dropped token is never drawn
    expected = exact_probabilities(x, kept)[kept] * DRAWS
    statistic = float(((counts[kept] - expected) ** 2 / expected).sum())
    dof = int(kept.sum()) - 1
    if dof == 0:
        return
    assert _p_value(statistic, dof) > 1e-3, (statistic, dof, counts.tolist())


def test_samples_of_neighbouring_seeds_differ() -> None:
    """Seed s sample j and seed s + 1 sample j - 1 draw from unrelated streams (seed + index shared one)."""
    positions = 64
    logits = torch.zeros(positions, 1000)  # uniform: any shared stream would give equal tokens

    def tokens(seed: int, sample: int) -> list[int]:
        keys = [rng_key(seed, sample, position) for position in range(positions)]
        params = SamplingTensors.build(temperature=[1.0] * positions, keys=keys)
        return get_sampler("cpu")(logits, params).token_ids.tolist()

    a, b = tokens(5, 1), tokens(6, 0)
    assert sum(x == y for x, y in zip(a, b, strict=True)) < 4
