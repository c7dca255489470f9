/* RMSNorm, rotary embeddings and gated activations on the CPU, fused the way decoder layers chain them.
 *
 * The specification is pagoda/pagedkernel/fused/torch_fused.py; every rounding of it is reproduced here:
 *   norm(x) = x * (1 / sqrt(mean(x^2) + eps)) in float32, then
 *     unit_offset (Gemma):  round(norm(x) * (1 + w))         (the product in float32, rounded once)
 *     otherwise (Llama):    round(w * round(norm(x)))        (normed rounded to the dtype, then the dtype's product)
 *   rotary (half split):    y1 = round(round(x1 * c) - round(x2 * s)),  y2 = round(round(x2 * c) + round(x1 * s))
 *   add_norm:               s = round(r + (w_pre ? norm_pre(x) : x)),   y = norm(s)
 *   act_and_mul:            y = round(round(act(gate)) * up), act GELU (tanh form) or SiLU, in float32
 * where round() is the storage dtype's rounding (-DPAGODA_DTYPE, cpu_dtype.h; none for float32): so a bfloat16
 * model rounds exactly where Hugging Face's modules round. Only the sum of squares is summed in another order
 * than torch's (sixteen lanes, then the tail), and exp is this file's polynomial rather than torch's (both within
 * a few float32 ulps). One call replaces the five to nine torch ops of each norm or
 * rotary, which at one decode token are microseconds of dispatch each. Rows are split over torch's OpenMP pool
 * when built with -fopenmp and the call is large enough; each row is computed whole by one thread.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_dtype.h"

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
PAGODA_DEFINE_LOADV(loadv16, v16f, 16)

/* Below this many elements a call runs on one thread: an OpenMP region costs more than a decode row's work. */
#define PARALLEL_MIN_WORK (1 << 16)

/* Store 16 float32 lanes as scalar_t, rounding as store1 does (to nearest even; NaN stays NaN). */
PAGODA_DEFINE_STOREV(storev16, v16f, 16)

/* a > b lane by lane (all ones where true), signed or unsigned as the lanes are. Without AVX-512, in two halves of
 * eight lanes: GCC compiled a sixteen-lane comparison into sixteen scalar compares on AVX2 (GELU took ~30 cycles an
 * element), and compiles an eight-lane one into one vector compare. */
#if defined(__AVX512F__)
static inline v16i gtv(v16f a, v16f b) { return a > b; }
static inline v16u gtuv(v16u a, v16u b) { return (v16u)(a > b); }
#else
#define PAGODA_HALVES_GT(name, V, H, M)                                                                       \
  static inline M name(V a, V b) {                                                                            \
    typedef __typeof__(a[0]) lane_t;                                                                          \
    typedef lane_t half_t __attribute__((vector_size(32)));                                                   \
    half_t ah[2], bh[2];                                                                                      \
    memcpy(ah, &a, sizeof ah);                                                                                \
    memcpy(bh, &b, sizeof bh);                                                                                \
    const H m[2] = {(H)(ah[0] > bh[0]), (H)(ah[1] > bh[1])};                                                  \
    M out;                                                                                                    \
    memcpy(&out, m, sizeof out);                                                                              \
    return out;                                                                                               \
  }
typedef int32_t v8i_half __attribute__((vector_size(32)));
typedef uint32_t v8u_half __attribute__((vector_size(32)));
PAGODA_HALVES_GT(gtv, v16f, v8i_half, v16i)
PAGODA_HALVES_GT(gtuv, v16u, v8u_half, v16u)
#undef PAGODA_HALVES_GT
#endif

/* x as stored in scalar_t and read back: the dtype's rounding (the identity for float32), in registers. */
static inline v16f roundv16(v16f x) {
#if PAGODA_DTYPE == PAGODA_FLOAT32
  return x;
#elif PAGODA_DTYPE == PAGODA_FLOAT16
  typedef _Float16 v16h __attribute__((vector_size(32)));
  return __builtin_convertvector(__builtin_convertvector(x, v16h), v16f);
#else
  v16u u;
  memcpy(&u, &x, sizeof u);
  const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const v16u quiet = (u | 0x400000u) & 0xffff0000u;
  const v16u nan = gtuv(u & 0x7fffffffu, (v16u){0} + 0x7f800000u);
  const v16u bits = (rounded & ~nan) | (quiet & nan);
  v16f out;
  memcpy(&out, &bits, sizeof out);
  return out;
#endif
}

static inline float round1(float x) {
  const scalar_t t = store1(x);
  return load1(&t);
}

/* 1 / sqrt(mean(x^2) + eps) of one row. */
static inline float inv_rms(const scalar_t *x, int64_t dim, float eps) {
  v16f acc = {0};
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) {
    const v16f v = loadv16(x + i);
    acc += v * v;
  }
  float sum = 0.0f;
  for (int lane = 0; lane < 16; lane++) sum += acc[lane];
  for (; i < dim; i++) {
    const float v = load1(x + i);
    sum += v * v;
  }
  return 1.0f / sqrtf(sum / (float)dim + eps);
}

/* y = the weighted norm of row x (see the header for the two forms). y may be x. */
static void norm_row(const scalar_t *x, const scalar_t *w, int64_t dim, float eps, int unit_offset, scalar_t *y) {
  const float inv = inv_rms(x, dim, eps);
  const v16f vinv = {inv, inv, inv, inv, inv, inv, inv, inv, inv, inv, inv, inv, inv, inv, inv, inv};
  int64_t i = 0;
  if (unit_offset) {
    for (; i + 16 <= dim; i += 16) storev16(y + i, (loadv16(x + i) * vinv) * (1.0f + loadv16(w + i)));
    for (; i < dim; i++) y[i] = store1((load1(x + i) * inv) * (1.0f + load1(w + i)));
  } else {
    for (; i + 16 <= dim; i += 16) storev16(y + i, loadv16(w + i) * roundv16(loadv16(x + i) * vinv));
    for (; i < dim; i++) y[i] = store1(load1(w + i) * round1(load1(x + i) * inv));
  }
}

/* Rotate row y in place by the angles whose cos and sin (scalar_t, half a row each) are c and s. */
static void rotate_row(scalar_t *y, const scalar_t *c, const scalar_t *s, int64_t dim) {
  const int64_t half = dim / 2;
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {
    const v16f x1 = loadv16(y + i), x2 = loadv16(y + half + i), vc = loadv16(c + i), vs = loadv16(s + i);
    storev16(y + i, roundv16(x1 * vc) - roundv16(x2 * vs));
    storev16(y + half + i, roundv16(x2 * vc) + roundv16(x1 * vs));
  }
  for (; i < half; i++) {
    const float x1 = load1(y + i), x2 = load1(y + half + i), ci = load1(c + i), si = load1(s + i);
    y[i] = store1(round1(x1 * ci) - round1(x2 * si));
    y[half + i] = store1(round1(x2 * ci) + round1(x1 * si));
  }
}

/* y[t, h, :] = rotary(norm(x[t, h, :])): row (t, h) of x at x + t * stride_t + h * stride_h, its `dim` values
 * contiguous; y contiguous [tokens, heads, dim]. w NULL: no norm (the row is copied); c NULL: no rotary. c and s
 * are [tokens, dim / 2] rows `cs_stride` apart. Returns 0, or 2 for an odd dim with a rotary. */
int pagoda_norm_rotary(const scalar_t *x, int64_t tokens, int64_t heads, int64_t stride_t, int64_t stride_h,
                       int64_t dim, const scalar_t *w, float eps, int unit_offset, const scalar_t *c,
                       const scalar_t *s, int64_t cs_stride, scalar_t *y, int64_t num_threads) {
  if (c != NULL && dim % 2 != 0) return 2;
  const int64_t rows = tokens * heads;
  const int parallel = rows * dim >= PARALLEL_MIN_WORK;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
  for (int64_t row = 0; row < rows; row++) {
    const int64_t t = row / heads, h = row % heads;
    const scalar_t *xr = x + t * stride_t + h * stride_h;
    scalar_t *yr = y + row * dim;
    if (w != NULL) {
      norm_row(xr, w, dim, eps, unit_offset, yr);
    } else {
      memcpy(yr, xr, (size_t)dim * sizeof(scalar_t));
    }
    if (c != NULL) rotate_row(yr, c + t * cs_stride, s + t * cs_stride, dim);
  }
  return 0;
}

/* sum[t] = round(r[t] + (w_pre ? norm_pre(x[t]) : x[t])) and y[t] = norm(sum[t]) with weight w, for `rows` rows
 * of `dim` values (x's rows x_stride apart; r, sum and y contiguous; sum may be r). */
int pagoda_add_norm(const scalar_t *x, int64_t x_stride, const scalar_t *r, int64_t rows, int64_t dim,
                    const scalar_t *w_pre, const scalar_t *w, float eps, int unit_offset, scalar_t *sum,
                    scalar_t *y, int64_t num_threads) {
  const int parallel = rows * dim >= PARALLEL_MIN_WORK;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
  for (int64_t t = 0; t < rows; t++) {
    const scalar_t *xr = x + t * x_stride, *rr = r + t * dim;
    scalar_t *sr = sum + t * dim, *yr = y + t * dim;
    const scalar_t *add = xr;
    if (w_pre != NULL) {
      norm_row(xr, w_pre, dim, eps, unit_offset, yr); /* y is scratch until the last norm */
      add = yr;
    }
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) storev16(sr + i, loadv16(rr + i) + loadv16(add + i));
    for (; i < dim; i++) sr[i] = store1(load1(rr + i) + load1(add + i));
    norm_row(sr, w, dim, eps, unit_offset, yr);
  }
  return 0;
}

/* a where mask (all ones) else b, lane by lane. */
static inline v16f selectv(v16i mask, v16f a, v16f b) {
  v16u ua, ub;
  memcpy(&ua, &a, sizeof ua);
  memcpy(&ub, &b, sizeof ub);
  const v16u m = (v16u)mask, bits = (ua & m) | (ub & ~m);
  v16f out;
  memcpy(&out, &bits, sizeof out);
  return out;
}

static inline v16f splat(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* exp(x) to about 2 float32 ulps: x = n ln2 + r with |r| <= ln2 / 2, a degree-7 polynomial in r (Cephes'
 * coefficients), times 2^n built in the exponent bits. Inputs are clamped to where the result is finite and
 * normal; NaN stays NaN. */
static inline v16f expv16(v16f x) {
  x = selectv(gtv(x, splat(88.3762626647949f)), splat(88.3762626647949f), x);
  x = selectv(gtv(splat(-87.3365447504019f), x), splat(-87.3365447504019f), x);
  const v16f shifter = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
  const v16f n = (x * splat(1.44269504088896341f) + shifter) - shifter;
  const v16f r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
  v16f p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16f scale;
  memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

/* The activation of one vector of gate values: GELU's tanh form 0.5 x (1 + tanh z), as torch writes it (its
 * 1 + tanh z cancels for very negative z, and so does this), tanh |z| = 1 - 2 / (exp(2 |z|) + 1); or SiLU,
 * x / (1 + exp(-x)). */
static inline v16f actv16(v16f g, int kind) {
  if (kind == 0) {
    const v16f z = splat(0.7978845608028654f) * (g + splat(0.044715f) * (g * g * g));
    const v16i negative = gtv(splat(0.0f), z);
    const v16f az = selectv(negative, -z, z);
    const v16f t = splat(1.0f) - splat(2.0f) / (expv16(splat(2.0f) * az) + splat(1.0f));
    return splat(0.5f) * g * (splat(1.0f) + selectv(negative, -t, t));
  }
  return g / (splat(1.0f) + expv16(-g));
}

/* y[t, i] = round(round(act(x[t, i])) * x[t, inner + i]) for the gate and up halves of each row of x (rows
 * x_stride apart; y contiguous [rows, inner]). kind 0: GELU (tanh), 1: SiLU. */
int pagoda_act_and_mul(const scalar_t *x, int64_t rows, int64_t x_stride, int64_t inner, int kind, scalar_t *y,
                       int64_t num_threads) {
  if (kind != 0 && kind != 1) return 2;
  const int parallel = rows * inner >= PARALLEL_MIN_WORK;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
  for (int64_t t = 0; t < rows; t++) {
    const scalar_t *gate = x + t * x_stride, *up = gate + inner;
    scalar_t *out = y + t * inner;
    int64_t i = 0;
    for (; i + 16 <= inner; i += 16) storev16(out + i, roundv16(actv16(loadv16(gate + i), kind)) * loadv16(up + i));
    if (i < inner) { /* the tail through a padded vector: the same function as the body's lanes */
      scalar_t g[16] = {0}, u[16] = {0}, o[16];
      memcpy(g, gate + i, (size_t)(inner - i) * sizeof(scalar_t));
      memcpy(u, up + i, (size_t)(inner - i) * sizeof(scalar_t));
      storev16(o, roundv16(actv16(loadv16(g), kind)) * loadv16(u));
      memcpy(out + i, o, (size_t)(inner - i) * sizeof(scalar_t));
    }
  }
  return 0;
}
