/* The storage dtype of the CPU kernels (cpu_attention.c, cpu_sampling.c) and its loads into float32.
 *
 * Picked by -DPAGODA_DTYPE=0 (float32), 1 (float16) or 2 (bfloat16), the ids of csrc.DTYPE_IDS: `scalar_t`, the
 * scalar `load1` / `store1`, and PAGODA_DEFINE_LOADV / PAGODA_DEFINE_STOREV, which define a vector load and a
 * rounding vector store of the width a kernel uses.
 * bfloat16 is kept as raw uint16_t bits and converted with integer shifts. csrc.read_source inlines this file in
 * place of its #include line, so the text a kernel is compiled from, and cbuild's cache key, carry it.
 */
#ifndef PAGODA_CPU_DTYPE_H
#define PAGODA_CPU_DTYPE_H

#include <stdint.h>
#include <string.h>

#define PAGODA_FLOAT32 0
#define PAGODA_FLOAT16 1
#define PAGODA_BFLOAT16 2

#ifndef PAGODA_DTYPE
#define PAGODA_DTYPE PAGODA_FLOAT32
#endif

/* PAGODA_DEFINE_LOADV(name, vec_t, lanes) defines `static inline vec_t name(const scalar_t *p)`: the `lanes`
 * scalars at p (unaligned) as a vector of float32, vec_t being float __attribute__((vector_size(4 * lanes))). A
 * macro, because attention loads eight lanes and sampling one register's width (8 or 16). */
#if PAGODA_DTYPE == PAGODA_FLOAT32
typedef float scalar_t;
static inline float load1(const scalar_t *p) { return *p; }
static inline scalar_t store1(float x) { return x; }
#define PAGODA_DEFINE_LOADV(name, vec_t, lanes) \
  static inline vec_t name(const scalar_t *p) { \
    vec_t v;                                    \
    memcpy(&v, p, sizeof v);                    \
    return v;                                   \
  }
#define PAGODA_DEFINE_STOREV(name, vec_t, lanes) \
  static inline void name(scalar_t *p, vec_t x) { memcpy(p, &x, sizeof x); }
#elif PAGODA_DTYPE == PAGODA_FLOAT16
typedef _Float16 scalar_t;
static inline float load1(const scalar_t *p) { return (float)*p; }
static inline scalar_t store1(float x) { return (scalar_t)x; }
#define PAGODA_DEFINE_LOADV(name, vec_t, lanes)                                 \
  static inline vec_t name(const scalar_t *p) {                                 \
    typedef _Float16 pagoda_halves __attribute__((vector_size(2 * (lanes))));   \
    pagoda_halves h;                                                            \
    memcpy(&h, p, sizeof h);                                                    \
    return __builtin_convertvector(h, vec_t);                                   \
  }
#define PAGODA_DEFINE_STOREV(name, vec_t, lanes)                                \
  static inline void name(scalar_t *p, vec_t x) {                              \
    typedef _Float16 pagoda_halves __attribute__((vector_size(2 * (lanes))));  \
    const pagoda_halves h = __builtin_convertvector(x, pagoda_halves);         \
    memcpy(p, &h, sizeof h);                                                   \
  }
#elif PAGODA_DTYPE == PAGODA_BFLOAT16
typedef uint16_t scalar_t;
static inline float load1(const scalar_t *p) {
  const uint32_t u = (uint32_t)*p << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static inline scalar_t store1(float x) { /* round to nearest even, as torch does; NaN stays NaN */
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (scalar_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (scalar_t)(u >> 16);
}
#define PAGODA_DEFINE_LOADV(name, vec_t, lanes)                                 \
  static inline vec_t name(const scalar_t *p) {                                 \
    typedef uint16_t pagoda_bits16 __attribute__((vector_size(2 * (lanes))));   \
    typedef uint32_t pagoda_bits32 __attribute__((vector_size(4 * (lanes))));   \
    pagoda_bits16 s;                                                            \
    memcpy(&s, p, sizeof s);                                                    \
    const pagoda_bits32 u = __builtin_convertvector(s, pagoda_bits32) << 16;    \
    vec_t f;                                                                    \
    memcpy(&f, &u, sizeof f);                                                   \
    return f;                                                                   \
  }
/* Round to nearest even lane by lane, as store1 does (a NaN stays a quiet NaN). */
#define PAGODA_DEFINE_STOREV(name, vec_t, lanes)                                                  \
  static inline void name(scalar_t *p, vec_t x) {                                                \
    typedef uint16_t pagoda_bits16 __attribute__((vector_size(2 * (lanes))));                    \
    typedef uint32_t pagoda_bits32 __attribute__((vector_size(4 * (lanes))));                    \
    pagoda_bits32 u;                                                                             \
    memcpy(&u, &x, sizeof u);                                                                    \
    const pagoda_bits32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;                        \
    const pagoda_bits32 quiet = (u >> 16) | 0x40u;                                               \
    const pagoda_bits32 nan = (pagoda_bits32)((u & 0x7fffffffu) > 0x7f800000u);                  \
    const pagoda_bits16 s = __builtin_convertvector((rounded & ~nan) | (quiet & nan), pagoda_bits16); \
    memcpy(p, &s, sizeof s);                                                                     \
  }
#else
#error "PAGODA_DTYPE must be 0 (float32), 1 (float16) or 2 (bfloat16)"
#endif

#endif /* PAGODA_CPU_DTYPE_H */
