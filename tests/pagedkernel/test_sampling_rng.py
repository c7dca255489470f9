"""The counter-based RNG and the float32 math every sampling backend shares."""

from __future__ import annotations

import math
import random

import torch
from pagoda.pagedkernel.sampling import rng_key, rng_keys
from pagoda.pagedkernel.sampling.fmath import EXP_LO, exp32, log32
from pagoda.pagedkernel.sampling.rng import MASK64, mix64, mix64_int, random_words, uniforms


def _as_unsigned(values: list[int]) -> list[int]:
    return [v & MASK64 for v in values]


def test_mix64_on_tensors_wraps_like_python_ints() -> None:
    """int64 tensor arithmetic (wrapping, logical shifts by masking) equals the unsigned 64-bit definition."""
    rnd = random.Random(0)
    values = [rnd.getrandbits(64) for _ in range(2000)] + [0, 1, MASK64, 1 << 63]
    signed = torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values], dtype=torch.int64)
    assert _as_unsigned(mix64(signed).tolist()) == [mix64_int(v) for v in values]
    # Key 0's stream is SplitMix64 seeded with 0, whose published first outputs are these.
    words = random_words(torch.tensor([0]), 6)[0].tolist()
    outputs = [words[i] | words[i + 1] << 32 for i in (0, 2, 4)]
    assert outputs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_keys_hash_seed_sample_and_position() -> None:
    """The tensor keys equal the scalar ones; seeds beyond int64 wrap; no two of these keys collide."""
    triples = [(s, j, p) for s in (0, 1, 2, 2**40, -3) for j in (0, 1, 2) for p in (0, 1, 7, 10**6)]
    keys = [rng_key(*t) for t in triples]
    assert len(set(keys)) == len(keys)
    seeds, samples, positions = (torch.tensor(c) for c in zip(*triples, strict=True))
    assert rng_keys(seeds, samples, positions).tolist() == keys
    assert rng_key(2**64 + 5, 1, 2) == rng_key(5, 1, 2)
    # The old rule seeded sample j with seed + j: seed 5 sample 1 and seed 6 sample 0 shared every draw.
    assert rng_key(5, 1, 0) != rng_key(6, 0, 0)


def test_words_and_uniforms_follow_the_definition() -> None:
    """Index i takes half i % 2 (low first) of output i // 2, mix64(key + (i // 2 + 1) * GOLDEN)."""
    keys = torch.tensor([rng_key(7, 0, 3), rng_key(8, 1, 0)])
    words = random_words(keys, 9)
    u = uniforms(keys, 9)
    for r, key in enumerate(keys.tolist()):
        for i in range(9):
            h = mix64_int((key & MASK64) + (i // 2 + 1) * 0x9E3779B97F4A7C15)
            word = (h >> 32) if i % 2 else (h & 0xFFFFFFFF)
            assert int(words[r, i]) == word
            assert float(u[r, i]) == (2 * (word >> 9) + 1) / 2**24
    assert bool(((u > 0) & (u < 1)).all())


def test_uniforms_look_uniform() -> None:
    """Mean, variance and a 16-bin histogram of 400,000 uniforms from 100 keys."""
    zeros = torch.zeros(100, dtype=torch.int64)
    u = uniforms(rng_keys(torch.arange(100), zeros, zeros), 4000)
    assert abs(float(u.mean()) - 0.5) < 0.002
    assert abs(float(u.var()) - 1 / 12) < 0.001
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    assert float(((counts - 25_000) ** 2 / 25_000).sum()) < 50  # chi-square, 15 dof: p ~ 1e-5


def test_exp32_and_log32_are_accurate() -> None:
    """Within 3 ulp of the true values; exp32(0) is exactly 1 and exp32 is 0 below EXP_LO."""
    x = torch.cat([torch.linspace(EXP_LO, 0.0, 20_001), torch.tensor([0.0, -1e-8, -0.5])])
    true = torch.tensor([math.exp(v) for v in x.double().tolist()], dtype=torch.float64)
    ulp = torch.finfo(torch.float32).eps * true
    assert bool(((exp32(x).double() - true).abs() <= 3 * ulp).all())
    assert float(exp32(torch.tensor([0.0]))) == 1.0
    assert exp32(torch.tensor([EXP_LO - 0.01, -1000.0, float("-inf")])).tolist() == [0.0, 0.0, 0.0]
    y = torch.cat([torch.logspace(-30, 2, 20_001), torch.tensor([1.0 - 2**-24, 2**-24, 1.0])])
    true = torch.tensor([math.log(v) for v in y.double().tolist()], dtype=torch.float64)
    error = (log32(y).double() - true).abs()
    assert bool((error <= 3 * torch.finfo(torch.float32).eps * true.abs().clamp_min(2**-24)).all())
