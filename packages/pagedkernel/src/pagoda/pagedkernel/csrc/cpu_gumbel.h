/* The sampler's scalar float32 log, its vector exp and its counter-based RNG: the Gumbel score of one (row key,
 * vocabulary index).
 *
 * Shared by cpu_sampling.c (the sampling op) and cpu_fused_head.c (the LM head fused with the draw), so that both
 * draw with the same bits: log32 is the exact operation sequence of sampling/fmath.py (compile with
 * -ffp-contract=off), word_at is sampling/rng.py's SplitMix64 stream. csrc.read_source inlines this file.
 */
#ifndef PAGODA_CPU_GUMBEL_H
#define PAGODA_CPU_GUMBEL_H

#include <stdint.h>
#include <string.h>

static inline float as_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static inline uint32_t as_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

#define LN2_HI 0x1.63p-1f
#define LN2_LO (-0x1.bd0106p-13f)
#define SQRT_HALF 0x1.6a09e6p-1f
#define GUMBEL_SPAN 17.0f /* > 24 ln 2 = 16.64: the most -log(-log u) can add to x */
#define LOG2E 0x1.715476p+0f
#define EXP_LO (-86.0f)

/* `static inline V name(V x)`: exp(x) for x <= 0 on a vector V of floats (I: its int32 lanes), sampling/fmath.py's
 * exp32 operations lane by lane (floor as truncation corrected downwards), 0 below EXP_LO; exp of 0 is exactly 1.
 * A macro for each file's vector width (cpu_sampling.c's, the fused head's). */
#define PAGODA_DEFINE_EXP32(name, V, I)                                                                       \
  static inline V name(V x) {                                                                                 \
    const I under = x < (V){0} + EXP_LO;                                                                      \
    const V xs = (V)((I)x & ~under); /* keep the lanes below EXP_LO finite; they return 0 */                  \
    const V t = xs * LOG2E + 0.5f;                                                                            \
    I n = __builtin_convertvector(t, I);                                                                      \
    n += (I)(__builtin_convertvector(n, V) > t); /* true is -1: floor for negative t */                       \
    const V fn = __builtin_convertvector(n, V);                                                               \
    V r = xs - fn * LN2_HI;                                                                                   \
    r = r - fn * LN2_LO;                                                                                      \
    const V z = r * r;                                                                                        \
    V p = (V){0} + 0x1.a0d2cep-13f;                                                                           \
    p = p * r + 0x1.6e879cp-10f;                                                                              \
    p = p * r + 0x1.11121p-7f;                                                                                \
    p = p * r + 0x1.555382p-5f;                                                                               \
    p = p * r + 0x1.555554p-3f;                                                                               \
    p = p * r + 0x1p-1f;                                                                                      \
    const V y = p * z + r + 1.0f;                                                                             \
    return (V)((I)(y * (V)((n + 127) << 23)) & ~under);                                                       \
  }

static inline float log32(float y) {
  const uint32_t bits = as_bits(y);
  const float mantissa = as_float((bits & 0x007fffffu) | 0x3f000000u);
  const int small = mantissa < SQRT_HALF;
  const float e = (float)((int32_t)(bits >> 23) - 126 - small);
  const float x = small ? mantissa + mantissa - 1.0f : mantissa - 1.0f;
  const float z = x * x;
  float p = 0x1.204376p-4f;
  p = p * x + -0x1.d7a37p-4f;
  p = p * x + 0x1.de4a34p-4f;
  p = p * x + -0x1.fcba9ep-4f;
  p = p * x + 0x1.23d37ep-3f;
  p = p * x + -0x1.555cap-3f;
  p = p * x + 0x1.999d58p-3f;
  p = p * x + -0x1.fffff8p-3f;
  p = p * x + 0x1.555554p-2f;
  float r = p * x * z;
  r = r + e * LN2_LO;
  r = r - 0.5f * z;
  return x + r + e * LN2_HI;
}

/* ---- the counter-based RNG: sampling/rng.py ---- */

#define GOLDEN 0x9e3779b97f4a7c15ull
static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
/* Word of vocabulary index i: half i % 2 (low half first) of output i / 2 of the row's stream. */
static inline uint32_t word_at(uint64_t key, int64_t i) {
  const uint64_t h = mix64(key + ((uint64_t)(i >> 1) + 1) * GOLDEN);
  return (i & 1) ? (uint32_t)(h >> 32) : (uint32_t)h;
}
/* The Gumbel score x - log(-log u) of a word's uniform u = (2k + 1) / 2^24. */
static inline float gumbel_score(float x, uint32_t word) {
  const float u = (float)(2 * (word >> 9) + 1) * 0x1p-24f;
  return x - log32(-log32(u));
}

#endif
