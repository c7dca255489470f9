"""The sampler's counter-based RNG: SplitMix64, keyed per row, one uniform per (row key, vocabulary index).

Why SplitMix64 and not Philox4x32-10: the i-th output of SplitMix64 is `mix64(key + (i + 1) * GOLDEN)`, a pure
function of (key, counter) like Philox's, but one output costs two 64-bit multiplies instead of Philox's ten
rounds of two 32x32-bit multiplies, and it is exact in torch's wrapping int64 arithmetic (the reference) as in C
and Triton. Its known weakness, two keys whose streams overlap when they differ by a small multiple of GOLDEN,
needs two row keys within vocab / 2 steps of each other: the keys are themselves mix64 hashes, so that has a
chance of about vocab^2 / 2^64 per pair of rows.

- Row key: `rng_key(seed, sample_index, position) = mix64(mix64(mix64(seed ^ SEED_SALT) ^ sample_index) ^
  position)`, the three hashed in turn (never seed + index, which gives seed s sample j the stream of seed s+1
  sample j-1).
- Words: output c (c = 0, 1, ...) of the row's stream is `mix64(key + (c + 1) * GOLDEN)`; vocabulary index i
  takes its 32-bit half i % 2 (the low half for even i), so one 64-bit hash serves two indices.
- Uniform: the top 23 bits k of the word give u = (2k + 1) / 2^24, exactly representable in float32 and
  strictly inside (0, 1).

All arithmetic here is on int64 tensors that wrap modulo 2^64 (two's complement); a right shift of a negative
int64 is arithmetic in torch, so logical shifts mask off the copied sign bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX_1 = 0xBF58476D1CE4E5B9
MIX_2 = 0x94D049BB133111EB
SEED_SALT = 0x5EED5EED5EED5EED  # so that seed 0 does not hash to key 0 (mix64(0) is 0)
UNIFORM_BITS = 23


def _signed(value: int) -> int:
    """The int64 whose two's-complement bits are the low 64 bits of `value`."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def mix64_int(z: int) -> int:
    """SplitMix64's output function (Stafford's Mix13) on a Python int, as an unsigned 64-bit int."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX_1) & MASK64
    z = ((z ^ (z >> 27)) * MIX_2) & MASK64
    return z ^ (z >> 31)


def rng_key(seed: int, sample_index: int, position: int) -> int:
    """The row key (as a signed int64, ready for a tensor) of one sample of a request at one output position."""
    h = mix64_int((seed ^ SEED_SALT) & MASK64)
    h = mix64_int(h ^ (sample_index & MASK64))
    return _signed(mix64_int(h ^ (position & MASK64)))


def _shift_right(z: Tensor, s: int) -> Tensor:  # int64
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: Tensor) -> Tensor:  # int64, any shape
    """SplitMix64's output function on int64 tensors (wrapping arithmetic)."""
    z = (z ^ _shift_right(z, 30)) * _signed(MIX_1)
    z = (z ^ _shift_right(z, 27)) * _signed(MIX_2)
    return z ^ _shift_right(z, 31)


def rng_keys(
    seeds: Tensor,  # int64 [rows]
    sample_indices: Tensor,  # int64 [rows]
    positions: Tensor,  # int64 [rows]
) -> Tensor:  # int64 [rows]
    """`rng_key` of every row at once."""
    h = mix64(seeds ^ _signed(SEED_SALT))
    h = mix64(h ^ sample_indices)
    return mix64(h ^ positions)


def random_words(
    keys: Tensor,  # int64 [rows]
    vocab: int,
) -> Tensor:  # int64 [rows, vocab], values in [0, 2^32)
    """The 32-bit random word of every (row, vocabulary index)."""
    pairs = (vocab + 1) // 2
    counters = torch.arange(1, pairs + 1, dtype=torch.int64, device=keys.device)
    h = mix64(keys.unsqueeze(1) + counters * _signed(GOLDEN))  # [rows, pairs]
    halves = torch.stack([h & 0xFFFFFFFF, _shift_right(h, 32)], dim=-1)  # [rows, pairs, 2]
    return halves.reshape(keys.shape[0], 2 * pairs)[:, :vocab]


def uniforms(
    keys: Tensor,  # int64 [rows]
    vocab: int,
) -> Tensor:  # float32 [rows, vocab], in [2^-24, 1 - 2^-24]
    """The uniform of every (row, vocabulary index): (2k + 1) / 2^24 from the word's top 23 bits k."""
    k = random_words(keys, vocab) >> (32 - UNIFORM_BITS)
    return (2 * k + 1).to(torch.float32) * 2.0**-24
