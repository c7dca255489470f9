/* Paged attention on the CPU: one pass over each sequence's cache blocks, read in place through its block table.
 *
 * The torch backend gathers every visible K/V block into a padded copy and then runs SDPA over it: three passes
 * over memory (read, write, read) and, for one query row per sequence, SDPA's tiling overhead. Here each work
 * item (a sequence, a KV head and a tile of its query tokens) streams the sequence's blocks once, computes the
 * scores of all its query rows (the tile's tokens x the KV head's group of query heads, so a key row loaded once
 * serves every row) and keeps an online softmax, as flash attention does. Vectors are GCC vector extensions
 * (AVX2/AVX-512 with -march=native, SSE otherwise); threads come from torch's OpenMP pool (pthreads when built
 * without OpenMP), one range of items each.
 *
 * Compiled by cpu_backend.py with -DPAGODA_DTYPE=0 (float32), 1 (float16) or 2 (bfloat16): q, out and the
 * caches share that dtype; everything is computed in float32. With -DPAGODA_KV_INT8 the caches are int8 instead,
 * with scales (value = q * scale): keys one per block, KV head and channel (k_scale, bfloat16 bits [num_blocks,
 * num_kv_heads, head_dim]), values one per token slot and KV head (v_scale, float32 [num_blocks, block_size,
 * num_kv_heads]). The block's channel scales multiply the query once per block (q . (k * s) = (q * s) . k), a
 * value row's scale its softmax weight, so int8 rows are converted to float32 in registers but never rescaled
 * element by element. The write rules (kv_quant.py's) are computed bit for bit.
 */
#include <float.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dtype.h"

typedef float v8f __attribute__((vector_size(32)));

/* No product and add is fused unless written as fma8 / fma16: under fp-contract=fast the compiler fuses where it
 * sees a product meet an add, and where a value meets two products (the rescaled accumulator acc * corr and the
 * first p * v) or one loop hands its sums to the next (the 8-column tails), which fusion it made changed with the
 * row count of each specialisation, and a row's output with it (found by
 * tests/pagedkernel/test_attention_row_invariance.py). Every fusion is written out instead, the same for any row
 * count. (The decode layers include this file: the pragma holds there too, inside their push / pop.) */
#pragma GCC optimize("fp-contract=off")
#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* a * b + c for one float, fused as fma8 is. */
static inline float fma1(float a, float b, float c) {
#if defined(__FMA__)
  return fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

/* a * b + c, one rounding where the build has FMA instructions (two otherwise, on every path alike). */
static inline v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__FMA__)
  return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

/* bfloat16 bits (the key scales) as float32, exactly. */
static inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
PAGODA_DEFINE_LOADV(load8, v8f, 8)

#ifdef PAGODA_KV_INT8
typedef int8_t cache_t;
#if defined(__AVX2__)
#include <immintrin.h>
/* Eight int8 values as float32 (exact): one sign-extending load and one conversion. GCC turns the generic
 * version below into eight scalar conversions (vcvtsi2ss); measured 11.8 -> 1.8 ms for a Gemma-shaped decode
 * batch (8 sequences x 4,096 keys), which makes int8 KV faster than bfloat16 KV (2.5 ms) instead of 4.7x slower. */
static inline v8f loadc8(const cache_t *p) {
  return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
typedef int8_t v8b __attribute__((vector_size(8)));
typedef int32_t v8i32 __attribute__((vector_size(32)));
static inline v8f loadc8(const cache_t *p) { /* eight int8 values as float32 (exact), any CPU */
  v8b b;
  memcpy(&b, p, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, v8i32), v8f);
}
#endif
#else
typedef scalar_t cache_t;
#define loadc8 load8
#endif

#define MAX_ROWS 32        /* query rows of one work item */
#define MAX_HEAD_DIM 512   /* a multiple of 8 */
#define MAX_BLOCK_SIZE 256
#define MAX_THREADS 64
#define TILE_ROWS 8        /* prefill tiles take max(1, TILE_ROWS / group) query tokens */

static inline v8f loadf(const float *p) {
  v8f v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline void storef(float *p, v8f v) { memcpy(p, &v, sizeof v); }
static inline float hsum(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

#if defined(__AVX512F__)
/* AVX-512: the hot loops of qk_block / pv_block take 32 columns a step for up to eight rows (two 16-lane
 * accumulators per row, sixteen of the 32 registers), so a prefill tile (8 rows) keeps its sums in registers at
 * twice the 256-bit width. Measured on a Sapphire Rapids Xeon, bfloat16, a 1,812-token prefill of 11 sequences
 * (Gemma 3 270M's 4 query heads over 1 KV head of 256): 7.4 -> 5.8 ms per layer; with the vectorised mask
 * (attend_item) 5.5, and with hsum4x16's four-row reductions 4.6. */
#define PAGODA_WIDE 1
#include <immintrin.h>
typedef float v16f __attribute__((vector_size(64)));
static inline v16f splat16(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline v16f fma16(v16f a, v16f b, v16f c) { return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
static inline v16f loadf16(const float *p) {
  v16f v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline void storef16(float *p, v16f v) { memcpy(p, &v, sizeof v); }
/* Four 16-lane sums at once, as the lanes of one 128-bit vector: a hadd tree instead of four separate
 * horizontal sums (those were a fifth of a prefill tile's time). */
static inline __m128 hsum4x16(const v16f *w) {
  __m256 h[4];
  for (int i = 0; i < 4; ++i) {
    const __m512 x = (__m512)w[i];
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  }
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#ifdef PAGODA_KV_INT8
static inline v16f loadc16(const cache_t *p) { /* sixteen int8 values as float32 (exact) */
  return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#else
PAGODA_DEFINE_LOADV(loadc16, v16f, 16)
#endif
#endif


typedef int32_t v8i __attribute__((vector_size(32)));

/* exp of eight softmax arguments (x - max <= 0; -inf gives 0): Cephes' expf, range reduction to
 * [-ln2/2, ln2/2] and a degree-7 polynomial, within 2 ulp of expf. Scalar expf was a third of the kernel's
 * arithmetic (measured: 8.1 -> 5.0 ms single-threaded on a cache-resident batch without it). */
static inline v8f exp8(v8f x) {
  const v8f lo = (v8f){0} - 87.0f; /* below this expf underflows to (nearly) 0 */
  const v8i under = x < lo;
  x = (v8f)(((v8i)x & ~under) | ((v8i)lo & under));
  const v8f t = fma8(x, splat8(1.44269504088896341f), splat8(0.5f));
  v8i n = __builtin_convertvector(t, v8i); /* truncation; floor for negative t below */
  n += (v8i)(__builtin_convertvector(n, v8f) > t); /* true is -1 */
  const v8f fn = __builtin_convertvector(n, v8f);
  const v8f r = fma8(fn, splat8(2.12194440e-4f), fma8(fn, splat8(-0.693359375f), x));
  v8f y = fma8(r, splat8(0.f), splat8(1.9875691500E-4f));
  y = fma8(y, r, splat8(1.3981999507E-3f));
  y = fma8(y, r, splat8(8.3334519073E-3f));
  y = fma8(y, r, splat8(4.1665795894E-2f));
  y = fma8(y, r, splat8(1.6666665459E-1f));
  y = fma8(y, r, splat8(5.0000001201E-1f));
  y = fma8(y, r * r, r) + 1.f;
  const v8i scale = (n + 127) << 23;
  return (v8f)((v8i)(y * (v8f)scale) & ~under);
}

typedef struct {
  const scalar_t *q;                     /* [num_tokens, num_heads, head_dim] */
  const cache_t *k_cache, *v_cache;      /* [blocks, bs, kvh, d] */
  const uint16_t *k_scale;               /* int8 caches: bfloat16 bits [blocks, kvh, d]; else NULL */
  const float *v_scale;                  /* int8 caches: [blocks, bs, kvh]; else NULL */
  scalar_t *out;                           /* [num_tokens, num_heads, head_dim] */
  const int32_t *block_tables, *query_start_loc, *context_lens;
  int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size, window;
  float scale, softcap;
} problem_t;

typedef struct {
  int64_t seq, kv_head, first_token, num_tokens; /* tokens first_token .. + num_tokens of the sequence's queries */
  int64_t first_head, num_group_heads; /* of the KV head's group of query heads: these (all G but in a decode
                                        * step that splits a group over threads, cpu_decode.c) */
} item_t;

typedef struct {
  const problem_t *p;
  const item_t *items;
  int64_t begin, end;
} range_t;

#ifdef PAGODA_WIDE
#define QK_ROWS 8 /* rows whose scores one pass over a key computes (the AVX-512 loop keeps 8 rows' sums) */
#else
#define QK_ROWS 4
#endif

/* sc[r][j] = q_r . k_j for up to QK_ROWS rows and one key, each row's sum in the same order whatever R is: a
 * speculative step verifies a token and its drafts in items of several rows where plain decoding computed each
 * token in an item of its own, and its tokens must be bitwise plain decoding's. The order of one row: with
 * AVX-512 and D >= 32, 32 columns a step into two 16-lane sums, added; where D is a multiple of 32 the 16 lanes
 * reduced as hsum4x16 reduces them (four rows at once, the rows left over padded with zero rows: each lane is
 * the same sum); otherwise those 16 lanes become the two 8-lane sums the loops below go on with: 16 columns a step, then 8,
 * reduced by hsum. */
static inline __attribute__((always_inline)) void qk_rows(const int R, const int64_t D, float (*qf)[MAX_HEAD_DIM],
                                                          const cache_t *kr, int64_t j,
                                                          float (*sc)[MAX_BLOCK_SIZE]) {
  /* Two accumulators per row: independent FMA chains hide the FMA latency. */
  v8f acc[QK_ROWS][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = (v8f){0};
  int64_t d = 0;
#ifdef PAGODA_WIDE
  if (D >= 32) {
    v16f wide[QK_ROWS][2];
    for (int r = 0; r < R; ++r) wide[r][0] = wide[r][1] = (v16f){0};
    for (; d + 32 <= D; d += 32) {
      const v16f k0 = loadc16(kr + d), k1 = loadc16(kr + d + 16);
      for (int r = 0; r < R; ++r) {
        wide[r][0] = fma16(loadf16(qf[r] + d), k0, wide[r][0]);
        wide[r][1] = fma16(loadf16(qf[r] + d + 16), k1, wide[r][1]);
      }
    }
    v16f w[QK_ROWS];
    for (int r = 0; r < R; ++r) w[r] = wide[r][0] + wide[r][1];
    if (d == D) { /* the common case (head_dim a multiple of 32): four rows per reduction */
      int r = 0;
      for (; r + 4 <= R; r += 4) {
        float sums[4];
        _mm_storeu_ps(sums, hsum4x16(w + r));
        for (int i = 0; i < 4; ++i) sc[r + i][j] = sums[i];
      }
      if (r < R) { /* the 1-3 rows left, padded with zero rows into one more reduction */
        v16f rest[4] = {(v16f){0}, (v16f){0}, (v16f){0}, (v16f){0}};
        for (int i = 0; r + i < R; ++i) rest[i] = w[r + i];
        float sums[4];
        _mm_storeu_ps(sums, hsum4x16(rest));
        for (int i = 0; r + i < R; ++i) sc[r + i][j] = sums[i];
      }
      return;
    }
    for (int r = 0; r < R; ++r) {
      acc[r][0] = (v8f){w[r][0], w[r][1], w[r][2], w[r][3], w[r][4], w[r][5], w[r][6], w[r][7]};
      acc[r][1] = (v8f){w[r][8], w[r][9], w[r][10], w[r][11], w[r][12], w[r][13], w[r][14], w[r][15]};
    }
  }
#endif
  for (; d + 16 <= D; d += 16) {
    const v8f k0 = loadc8(kr + d), k1 = loadc8(kr + d + 8);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = fma8(loadf(qf[r] + d), k0, acc[r][0]);
      acc[r][1] = fma8(loadf(qf[r] + d + 8), k1, acc[r][1]);
    }
  }
  for (; d < D; d += 8) {
    const v8f k0 = loadc8(kr + d);
    for (int r = 0; r < R; ++r) acc[r][0] = fma8(loadf(qf[r] + d), k0, acc[r][0]);
  }
  for (int r = 0; r < R; ++r) sc[r][j] = hsum(acc[r][0] + acc[r][1]);
}

#if defined(PAGODA_WIDE) && defined(__AVX512BF16__) && PAGODA_DTYPE == PAGODA_BFLOAT16 && !defined(PAGODA_KV_INT8)
/* bfloat16 caches on a CPU with AVX-512 BF16: the scores and P @ V by vdpbf16ps. The query and the keys are
 * bfloat16 already, so each product is exact in float32 and only the sums round (as in a bfloat16 matmul with
 * float32 accumulation, what SDPA computes for a bfloat16 model); the scale multiplies the float32 sum. Half the
 * vector instructions of the float32 loops above, and no conversion of the cache's elements. */
#define PAGODA_BF16_DOT 1
#define BF16_DOT_ROWS 8 /* rows of one P @ V pass (two 16-column sums each) */

/* sc[r][j] = scale * (q_r . k_j) for up to QK_ROWS rows and one key (D a multiple of 32; qp: each row's query as
 * bfloat16 pairs), each row's sum in the same order whatever R: 64 columns a step, the first 32 into one 16-lane
 * sum and the next 32 into another (two products a lane each), added, then reduced by hsum4x16 four rows at a
 * time (the rows left over padded with zero rows). The keys are read in order, as qk_rows reads them: a layout
 * that transposed sixteen keys into lanes first (no horizontal sums) was faster on cached keys and 1.2-1.7x
 * slower on keys streamed from memory (a long context, a large batch), measured. */
static inline __attribute__((always_inline)) void qk_rows_bf16(const int R, const int64_t D,
                                                               const uint32_t (*qp)[MAX_HEAD_DIM / 2],
                                                               float scale, const cache_t *kr, int64_t j,
                                                               float (*sc)[MAX_BLOCK_SIZE]) {
  __m512 first[QK_ROWS], second[QK_ROWS];
  for (int r = 0; r < R; ++r) first[r] = second[r] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kr + d), k1 = (__m512bh)_mm512_loadu_si512(kr + d + 32);
    for (int r = 0; r < R; ++r) {
      first[r] = _mm512_dpbf16_ps(first[r], k0, (__m512bh)_mm512_load_si512(qp[r] + d / 2));
      second[r] = _mm512_dpbf16_ps(second[r], k1, (__m512bh)_mm512_load_si512(qp[r] + d / 2 + 16));
    }
  }
  if (d < D) { /* 32 columns left */
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kr + d);
    for (int r = 0; r < R; ++r)
      first[r] = _mm512_dpbf16_ps(first[r], k0, (__m512bh)_mm512_load_si512(qp[r] + d / 2));
  }
  v16f w[4];
  for (int r0 = 0; r0 < R; r0 += 4) {
    for (int i = 0; i < 4; ++i) w[i] = r0 + i < R ? (v16f)_mm512_add_ps(first[r0 + i], second[r0 + i]) : (v16f){0};
    float sums[4];
    _mm_storeu_ps(sums, hsum4x16(w));
    for (int i = 0; i < 4 && r0 + i < R; ++i) sc[r0 + i][j] = sums[i] * scale;
  }
}

#endif

/* sc[r][j] = q_r . k_j for the n keys of one block (rows `row` elements apart), QK_ROWS rows at a time (each
 * row's order as qk_rows says). Meanwhile the block's V rows (read next, by pv_block) and the next block's K rows
 * (kn, NULL if none) are prefetched: blocks sit anywhere in the pool, so no hardware prefetcher can guess them;
 * measured 20% faster on a pool larger than the caches. With qp (bfloat16 builds with AVX-512 BF16; else NULL)
 * the scores are qk_rows_bf16's of its bfloat16 pairs, times `scale`. */
static inline __attribute__((always_inline)) void qk_block(const int R, const int64_t D, float (*qf)[MAX_HEAD_DIM],
                                                           const uint32_t (*qp)[MAX_HEAD_DIM / 2], float scale,
                                                           const cache_t *kb, const cache_t *vb,
                                                           const cache_t *kn, int64_t row, int64_t n,
                                                           float (*sc)[MAX_BLOCK_SIZE]) {
  const int64_t line = 64 / sizeof(cache_t);
  for (int64_t j = 0; j < n; ++j) {
    const cache_t *kr = kb + j * row;
    for (int64_t c = 0; c < D; c += line) {
      __builtin_prefetch(vb + j * row + c);
      if (kn) __builtin_prefetch(kn + j * row + c);
    }
    for (int r0 = 0; r0 < R; r0 += QK_ROWS) {
      const int rows = R - r0 < QK_ROWS ? R - r0 : QK_ROWS;
#ifdef PAGODA_BF16_DOT
      if (qp) {
        qk_rows_bf16(rows, D, qp + r0, scale, kr, j, sc + r0);
        continue;
      }
#endif
      qk_rows(rows, D, qf + r0, kr, j, sc + r0);
    }
  }
  (void)qp, (void)scale; /* only read by the bfloat16 path */
}

#if defined(PAGODA_BF16_DOT)

/* vpermt2w indices interleaving two keys' value rows: lane 2c of the result is column c of the first (index c),
 * lane 2c + 1 column c of the second (32 + c); PAIR_LO for columns 0-15 of a 32-column chunk, PAIR_HI for 16-31. */
static const uint16_t PAIR_LO[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t PAIR_HI[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

/* acc[r] = acc[r] * corr[r] + sum_j p[r][j] * v_j by vdpbf16ps over pairs of keys: the weights rounded to
 * bfloat16 (as SDPA rounds them for a bfloat16 model's P @ V), each value column's pair (v_j, v_j+1) next to the
 * weights' pair, so one instruction adds two keys' exact products to sixteen columns. A row's sum runs over its
 * pairs in order, the same whatever R; the odd key at the end is paired with a zero weight and a zero row (the
 * slot after it may be unwritten). D a multiple of 32; rows eight at a time. */
static inline __attribute__((always_inline)) void pv_block_bf16(const int R, const int64_t D,
                                                                float (*acc)[MAX_HEAD_DIM], const float *corr,
                                                                const cache_t *vb, int64_t row, int64_t n,
                                                                float (*p)[MAX_BLOCK_SIZE]) {
  uint32_t pp[MAX_ROWS][MAX_BLOCK_SIZE / 2] __attribute__((aligned(64))); /* [row][pair of keys] */
  const int64_t pairs = (n + 1) / 2;
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < n; j += 16)
      _mm256_store_si256((__m256i *)((uint16_t *)pp[r] + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p[r] + j)));
    if (n & 1) pp[r][n / 2] &= 0xffffu; /* the weight past the last key: zero */
  }
  const __m512i lo_idx = _mm512_loadu_si512(PAIR_LO), hi_idx = _mm512_loadu_si512(PAIR_HI);
  for (int64_t d = 0; d < D; d += 32)
    for (int r0 = 0; r0 < R; r0 += BF16_DOT_ROWS) {
      const int rows = R - r0 < BF16_DOT_ROWS ? R - r0 : BF16_DOT_ROWS;
      __m512 a[BF16_DOT_ROWS][2];
      for (int r = 0; r < rows; ++r) {
        a[r][0] = _mm512_mul_ps(_mm512_loadu_ps(acc[r0 + r] + d), _mm512_set1_ps(corr[r0 + r]));
        a[r][1] = _mm512_mul_ps(_mm512_loadu_ps(acc[r0 + r] + d + 16), _mm512_set1_ps(corr[r0 + r]));
      }
      for (int64_t i = 0; i < pairs; ++i) {
        const __m512i v0 = _mm512_loadu_si512(vb + 2 * i * row + d);
        const __m512i v1 = 2 * i + 1 < n ? _mm512_loadu_si512(vb + (2 * i + 1) * row + d) : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_permutex2var_epi16(v0, lo_idx, v1);
        const __m512bh hi = (__m512bh)_mm512_permutex2var_epi16(v0, hi_idx, v1);
        for (int r = 0; r < rows; ++r) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[r0 + r][i]);
          a[r][0] = _mm512_dpbf16_ps(a[r][0], lo, w);
          a[r][1] = _mm512_dpbf16_ps(a[r][1], hi, w);
        }
      }
      for (int r = 0; r < rows; ++r) {
        _mm512_storeu_ps(acc[r0 + r] + d, a[r][0]);
        _mm512_storeu_ps(acc[r0 + r] + d + 16, a[r][1]);
      }
    }
}
#endif

/* acc[r] = acc[r] * corr[r] + sum_j p[r][j] * v_j, with the rows' sums in registers: sixteen columns at a time
 * for up to four rows (eight independent FMA chains: with one chain per row the FMA latency, not the loads, set
 * the pace; measured 2x on this loop), else eight. */
static inline __attribute__((always_inline)) void pv_block(const int R, const int64_t D, float (*acc)[MAX_HEAD_DIM],
                                                           const float *corr, const cache_t *vb, int64_t row,
                                                           int64_t n, float (*p)[MAX_BLOCK_SIZE]) {
  int64_t d = 0;
#ifdef PAGODA_WIDE
  if (R <= 8) {
    for (; d + 32 <= D; d += 32) {
      v16f a[MAX_ROWS][2];
      for (int r = 0; r < R; ++r) {
        a[r][0] = loadf16(acc[r] + d) * corr[r];
        a[r][1] = loadf16(acc[r] + d + 16) * corr[r];
      }
      for (int64_t j = 0; j < n; ++j) {
        const v16f v0 = loadc16(vb + j * row + d), v1 = loadc16(vb + j * row + d + 16);
        for (int r = 0; r < R; ++r) {
          a[r][0] = fma16(splat16(p[r][j]), v0, a[r][0]);
          a[r][1] = fma16(splat16(p[r][j]), v1, a[r][1]);
        }
      }
      for (int r = 0; r < R; ++r) {
        storef16(acc[r] + d, a[r][0]);
        storef16(acc[r] + d + 16, a[r][1]);
      }
    }
  }
#endif
  if (R <= 4) {
    for (; d + 16 <= D; d += 16) {
      v8f a[MAX_ROWS][2];
      for (int r = 0; r < R; ++r) {
        a[r][0] = loadf(acc[r] + d) * corr[r];
        a[r][1] = loadf(acc[r] + d + 8) * corr[r];
      }
      for (int64_t j = 0; j < n; ++j) {
        const v8f v0 = loadc8(vb + j * row + d), v1 = loadc8(vb + j * row + d + 8);
        for (int r = 0; r < R; ++r) {
          a[r][0] = fma8(splat8(p[r][j]), v0, a[r][0]);
          a[r][1] = fma8(splat8(p[r][j]), v1, a[r][1]);
        }
      }
      for (int r = 0; r < R; ++r) {
        storef(acc[r] + d, a[r][0]);
        storef(acc[r] + d + 8, a[r][1]);
      }
    }
  }
  for (; d < D; d += 8) {
    v8f a[MAX_ROWS];
    for (int r = 0; r < R; ++r) {
      a[r] = loadf(acc[r] + d) * corr[r];
    }
    for (int64_t j = 0; j < n; ++j) {
      const v8f v = loadc8(vb + j * row + d);
      for (int r = 0; r < R; ++r) a[r] = fma8(splat8(p[r][j]), v, a[r]);
    }
    for (int r = 0; r < R; ++r) storef(acc[r] + d, a[r]);
  }
}

/* The first key a query at `pos` sees. */
static inline int64_t first_key(const problem_t *p, int64_t pos) {
  return p->window > 0 && pos >= p->window ? pos - p->window + 1 : 0;
}

static inline __attribute__((always_inline)) void attend_item(const int R, const problem_t *p, const item_t *it) {
  const int64_t G = p->num_heads / p->num_kv_heads, D = p->head_dim, BS = p->block_size;
  const int64_t row = p->num_kv_heads * D; /* cache elements from one slot to the next */
  const int64_t s = it->seq, h = it->kv_head;
  const int64_t q_start = p->query_start_loc[s], q_len = p->query_start_loc[s + 1] - q_start;
  const int64_t ctx = p->context_lens[s];
  float qf[MAX_ROWS][MAX_HEAD_DIM] __attribute__((aligned(64)));
  float acc[MAX_ROWS][MAX_HEAD_DIM] __attribute__((aligned(64)));
#ifdef PAGODA_KV_INT8
  float qs[MAX_ROWS][MAX_HEAD_DIM] __attribute__((aligned(64))); /* qf times the current block's K scales */
#endif
  float sc[MAX_ROWS][MAX_BLOCK_SIZE] __attribute__((aligned(64)));
  float m[MAX_ROWS], l[MAX_ROWS], corr[MAX_ROWS];
#ifdef PAGODA_BF16_DOT
  uint32_t qp[MAX_ROWS][MAX_HEAD_DIM / 2] __attribute__((aligned(64))); /* the raw query rows, as pairs */
  const int bf16_dot = D % 32 == 0;
#else
  const int bf16_dot = 0;
#endif
  int64_t lo[MAX_ROWS], hi[MAX_ROWS]; /* row r sees keys lo[r] .. hi[r] */
  /* Row r = t * n + i (n = num_group_heads): query token first_token + t, query head h * G + first_head + i. */
  for (int r = 0; r < R; ++r) {
    const int64_t n = it->num_group_heads, t = it->first_token + r / n, head = h * G + it->first_head + r % n;
    const scalar_t *qr = p->q + ((q_start + t) * p->num_heads + head) * D;
    for (int64_t d = 0; d < D; ++d) acc[r][d] = 0.f;
    if (!bf16_dot) /* the float32 loops' query, prescaled */
      for (int64_t d = 0; d < D; ++d) qf[r][d] = load1(qr + d) * p->scale;
#ifdef PAGODA_BF16_DOT
    else
      memcpy(qp[r], qr, D * sizeof(scalar_t));
#endif
    hi[r] = ctx - q_len + t;
    lo[r] = first_key(p, hi[r]);
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  const int32_t *table = p->block_tables + s * p->max_blocks;
  const int64_t end = hi[R - 1] + 1; /* never past the last written slot: unwritten slots may hold NaN bits */
  /* Whole blocks from the first row's first block on (its keys before lo[0], written tokens of this sequence,
   * masked): each row's keys then sit in the same lanes of the same chunks whichever row starts its item, so a
   * windowed row's softmax sums in the same order alone as in a tile. */
  for (int64_t t0 = lo[0] / BS * BS; t0 < end;) {
    const int64_t b = t0 / BS, off = t0 % BS;
    const int64_t n = t0 + (BS - off) <= end ? BS - off : end - t0;
    const int64_t base = ((int64_t)table[b] * BS + off) * row + h * D;
    const cache_t *kn = t0 + n < end ? p->k_cache + (int64_t)table[b + 1] * BS * row + h * D : NULL;
#ifdef PAGODA_KV_INT8
    /* The block's channel scales folded into the query rows: R * D products per block instead of n * D. */
    const uint16_t *ks = p->k_scale + ((int64_t)table[b] * p->num_kv_heads + h) * D;
    float ksf[MAX_HEAD_DIM] __attribute__((aligned(64)));
    for (int64_t d = 0; d < D; ++d) ksf[d] = bf16_to_f32(ks[d]);
    for (int r = 0; r < R; ++r)
      for (int64_t d = 0; d < D; d += 8) storef(qs[r] + d, loadf(qf[r] + d) * loadf(ksf + d));
    qk_block(R, D, qs, NULL, 1.f, p->k_cache + base, p->v_cache + base, kn, row, n, sc);
    /* The value rows' scales, one per slot (only the n read: the rest of the block may be unwritten). */
    float sv[MAX_BLOCK_SIZE];
    const int64_t first_slot = (int64_t)table[b] * BS + off;
    for (int64_t j = 0; j < n; ++j) sv[j] = p->v_scale[(first_slot + j) * p->num_kv_heads + h];
#else
#ifdef PAGODA_BF16_DOT
    if (bf16_dot)
      qk_block(R, D, qf, qp, p->scale, p->k_cache + base, p->v_cache + base, kn, row, n, sc);
    else
#endif
      qk_block(R, D, qf, NULL, 1.f, p->k_cache + base, p->v_cache + base, kn, row, n, sc);
#endif
    const int64_t n8 = (n + 7) & ~(int64_t)7; /* the exps run eight keys at a time; lanes past n give 0 */
    for (int r = 0; r < R; ++r) {
      float mx = -INFINITY;
      if (p->softcap > 0.f) {
        for (int64_t j = 0; j < n8; ++j) {
          const int64_t key = t0 + j;
          float x = p->softcap * tanhf(sc[r][j] / p->softcap);
          x = j < n && key >= lo[r] && key <= hi[r] ? x : -INFINITY;
          sc[r][j] = x;
          mx = x > mx ? x : mx;
        }
      } else {
        /* The same mask and maximum eight keys at a time: with one scalar pass per row and key, this loop cost
         * as much as the dot products of a prefill tile. Key positions fit int32 (context lengths are int32). */
        const v8i iota = {0, 1, 2, 3, 4, 5, 6, 7};
        const v8i neg_inf = (v8i)((v8f){0} - INFINITY);
        const v8i first = (v8i){0} + (int32_t)(lo[r] - t0), last = (v8i){0} + (int32_t)(hi[r] - t0);
        const v8i count = (v8i){0} + (int32_t)n;
        v8f vmx = (v8f)neg_inf;
        for (int64_t j = 0; j < n8; j += 8) {
          const v8i jj = iota + (int32_t)j;
          const v8i ok = (jj < count) & (jj >= first) & (jj <= last);
          const v8f x = (v8f)(((v8i)loadf(sc[r] + j) & ok) | (neg_inf & ~ok));
          storef(sc[r] + j, x);
          const v8i gt = x > vmx;
          vmx = (v8f)(((v8i)x & gt) | ((v8i)vmx & ~gt));
        }
        for (int k = 0; k < 8; ++k) mx = vmx[k] > mx ? vmx[k] : mx;
      }
      if (mx == -INFINITY) { /* nothing visible to this row here */
        corr[r] = 1.f;
        for (int64_t j = 0; j < n; ++j) sc[r][j] = 0.f;
        continue;
      }
      const float new_m = mx > m[r] ? mx : m[r];
      corr[r] = expf(m[r] - new_m); /* exp(-inf) = 0 on the first visible block */
      v8f sum = {0};
      for (int64_t j = 0; j < n8; j += 8) {
        const v8f e = exp8(loadf(sc[r] + j) - new_m);
        storef(sc[r] + j, e);
        sum += e;
      }
      l[r] = fma1(l[r], corr[r], hsum(sum));
      m[r] = new_m;
#ifdef PAGODA_KV_INT8
      for (int64_t j = 0; j < n; ++j) sc[r][j] *= sv[j]; /* each key's V scale, applied to its weight */
#endif
    }
#ifdef PAGODA_BF16_DOT
    if (bf16_dot)
      pv_block_bf16(R, D, acc, corr, p->v_cache + base, row, n, sc);
    else
#endif
      pv_block(R, D, acc, corr, p->v_cache + base, row, n, sc);
    t0 += n;
  }
  for (int r = 0; r < R; ++r) {
    const int64_t n = it->num_group_heads, t = it->first_token + r / n, head = h * G + it->first_head + r % n;
    scalar_t *o = p->out + ((q_start + t) * p->num_heads + head) * D;
    const float inv = 1.f / l[r]; /* l > 0: every row sees at least its own key */
    for (int64_t d = 0; d < D; ++d) o[d] = store1(acc[r][d] * inv);
  }
}

/* attend_item for one (sequence, KV head, tile of tokens) item of `rows` rows (tokens x query heads): a constant
 * row count for the common tiles lets the compiler keep every row's sums in registers (the generic one spills
 * them: SmolLM2's 3 and 6 rows ran prompts 1.7-2x slower through it). */
static void attend_rows(const problem_t *p, const item_t *it, int64_t rows) {
  switch (rows) {
    case 1: attend_item(1, p, it); break;
    case 2: attend_item(2, p, it); break;
    case 3: attend_item(3, p, it); break;
    case 4: attend_item(4, p, it); break;
    case 6: attend_item(6, p, it); break;
    case 8: attend_item(8, p, it); break;
    default: attend_item((int)rows, p, it); break;
  }
}

static void *run_range(void *arg) {
  const range_t *range = (const range_t *)arg;
  const int64_t G = range->p->num_heads / range->p->num_kv_heads;
  for (int64_t i = range->begin; i < range->end; ++i)
    attend_rows(range->p, &range->items[i], range->items[i].num_tokens * G);
  return NULL;
}

/* Keys item `it` reads times its rows: the work it costs. */
static int64_t item_cost(const problem_t *p, const item_t *it) {
  const int64_t s = it->seq, q_len = p->query_start_loc[s + 1] - p->query_start_loc[s];
  const int64_t last = p->context_lens[s] - q_len + it->first_token + it->num_tokens - 1;
  const int64_t first = first_key(p, last - it->num_tokens + 1);
  return (last - first + 1) * it->num_tokens;
}

/* Attention of every query token of every sequence over its paged K/V; 0 on success, 1 for unsupported sizes,
 * 2 when out of memory. Query token t of sequence s (rows query_start_loc[s] + t) sits at position
 * context_lens[s] - q_len + t and sees the keys up to its own position (the last `window` of them if window > 0). */
int pagoda_paged_attention(const void *q, void *out, const void *k_cache, const void *v_cache,
                           const uint16_t *k_scale, const float *v_scale, const int32_t *block_tables, int64_t max_blocks, const int32_t *query_start_loc,
                           const int32_t *context_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t window, float scale, float softcap,
                           int64_t num_threads) {
  if (num_kv_heads < 1 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_ROWS || head_dim < 8 ||
      head_dim > MAX_HEAD_DIM || head_dim % 8 || block_size < 1 || block_size > MAX_BLOCK_SIZE)
    return 1;
#ifdef PAGODA_KV_INT8
  if (!k_scale || !v_scale) return 1;
#endif
  const problem_t p = {(const scalar_t *)q, (const cache_t *)k_cache, (const cache_t *)v_cache, k_scale, v_scale,
                       (scalar_t *)out, block_tables, query_start_loc, context_lens, max_blocks, num_heads, num_kv_heads,
                       head_dim, block_size, window, scale, softcap};
  const int64_t G = num_heads / num_kv_heads;
  const int64_t tile = G >= TILE_ROWS ? 1 : TILE_ROWS / G;
  int64_t count = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
    count += num_kv_heads * ((q_len + tile - 1) / tile);
  }
  if (count == 0) return 0;
  item_t *items = malloc(sizeof(item_t) * (size_t)count);
  int64_t *cost = malloc(sizeof(int64_t) * (size_t)count);
  if (!items || !cost) {
    free(items);
    free(cost);
    return 2;
  }
  int64_t n = 0, total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t t = 0; t < q_len; t += tile) {
        items[n] = (item_t){s, h, t, q_len - t < tile ? q_len - t : tile, 0, G};
        cost[n] = item_cost(&p, &items[n]);
        total += cost[n++];
      }
    }
  }
  /* Contiguous ranges of about equal cost, one per thread. */
  if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
  if (num_threads > count) num_threads = count;
  if (num_threads < 1) num_threads = 1;
  range_t ranges[MAX_THREADS];
  int64_t next = 0, done = 0;
  for (int64_t t = 0; t < num_threads; ++t) {
    const int64_t target = total * (t + 1) / num_threads;
    ranges[t] = (range_t){&p, items, next, next};
    while (next < count && (t == num_threads - 1 || done < target)) done += cost[next++];
    ranges[t].end = next;
  }
#ifdef _OPENMP
  /* torch's own OpenMP pool (the libgomp.so.1 that torch loaded serves this library too): its threads are
   * awake after the previous op, and no second pool spins against them (pthreads here measured 13 vs 10.6 ms per
   * layer in the engine while torch's idle workers spun). A pool smaller than asked for runs several ranges. */
#pragma omp parallel num_threads(num_threads)
  for (int64_t t = omp_get_thread_num(); t < num_threads; t += omp_get_num_threads()) run_range(&ranges[t]);
#else
  /* The calling thread runs the first range. */
  pthread_t threads[MAX_THREADS];
  int started[MAX_THREADS] = {0};
  for (int64_t t = 1; t < num_threads; ++t)
    started[t] = pthread_create(&threads[t], NULL, run_range, &ranges[t]) == 0;
  run_range(&ranges[0]);
  for (int64_t t = 1; t < num_threads; ++t) {
    if (started[t])
      pthread_join(threads[t], NULL);
    else
      run_range(&ranges[t]); /* no thread to be had: run its range here */
  }
#endif
  free(items);
  free(cost);
  return 0;
}

/* Write token t's key and value rows (num_kv_heads * head_dim elements, `key_stride` / `value_stride` elements
 * from one token to the next) into cache slot slots[t]; negative slots are padding and skipped. One memcpy per
 * row: torch's index_copy_ took ~0.3 ms for a decode batch's 110 rows, as long as the copy itself ~30 times. */
int64_t pagoda_reshape_and_cache(const void *key, const void *value, void *k_cache, void *v_cache,
                                 const int64_t *slots, int64_t num_tokens, int64_t num_slots, int64_t row,
                                 int64_t key_stride, int64_t value_stride) {
  /* Every slot is checked before anything is written: a bad one (returned as token + 1) changes nothing. */
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slots[t] >= num_slots) return t + 1;
  const scalar_t *k = (const scalar_t *)key, *v = (const scalar_t *)value;
  scalar_t *kc = (scalar_t *)k_cache, *vc = (scalar_t *)v_cache;
  const size_t bytes = sizeof(scalar_t) * (size_t)row;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;
    memcpy(kc + slots[t] * row, k + t * key_stride, bytes);
    memcpy(vc + slots[t] * row, v + t * value_stride, bytes);
  }
  return 0;
}

#ifdef PAGODA_KV_INT8
/* Quantize one value row of D values into q (kv_quant.write_int8_values) and return its scale: the row's
 * absolute maximum / 127 (at least FLT_MIN), then float32 `x / scale` rounded by rintf (half to even), as
 * torch's division and round do, so the two agree bit for bit. */
static inline float quantize_row(const scalar_t *x, int8_t *q, int64_t D) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    const float a = fabsf(load1(x + d));
    amax = a > amax ? a : amax;
  }
  float scale = amax / 127.f;
  scale = scale > FLT_MIN ? scale : FLT_MIN;
  for (int64_t d = 0; d < D; ++d) {
    float y = rintf(load1(x + d) / scale);
    y = y > 127.f ? 127.f : (y < -127.f ? -127.f : y);
    q[d] = (int8_t)y;
  }
  return scale;
}

/* A positive float32 rounded up to a bfloat16 value (kv_quant.ceil_bfloat16), and that value's bits. */
static inline float ceil_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  u = (u + 0xFFFFu) & 0xFFFF0000u;
  memcpy(&x, &u, sizeof x);
  return x;
}
static inline uint16_t bf16_bits(float x) { /* exact for a bfloat16 value (or a NaN read from one) */
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return (uint16_t)(u >> 16);
}

/* Quantize the key rows of tokens t0 .. t1 - 1 (all in cache block `block`, at offsets `first` and up):
 * kv_quant.write_int8_keys' rule per KV head and channel. A channel's scale is its rows' absolute maximum / 127
 * when the rows start the block (offset 0); otherwise it grows to cover them, and the channel's rows already in
 * the block are requantized to the grown scale (round(q * old / new)), so nothing is clamped. Scales are stored
 * as bfloat16, rounded up (never below amax / 127). `amax` is scratch of D floats. */
static void write_keys_int8(const scalar_t *x, int64_t stride, const int64_t *slots, int64_t t0, int64_t t1,
                            int8_t *cache, uint16_t *scales, int64_t block, int64_t first, int64_t block_size,
                            int64_t H, int64_t D, float *amax) {
  const int64_t row = H * D;
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t d = 0; d < D; ++d) amax[d] = 0.f;
    for (int64_t t = t0; t < t1; ++t) {
      if (slots[t] < 0) continue;
      const scalar_t *xr = x + t * stride + h * D;
      for (int64_t d = 0; d < D; ++d) {
        const float a = fabsf(load1(xr + d));
        amax[d] = a > amax[d] ? a : amax[d];
      }
    }
    uint16_t *sc = scales + (block * H + h) * D;
    for (int64_t d = 0; d < D; ++d) {
      float fresh = amax[d] / 127.f;
      fresh = ceil_bf16(fresh > FLT_MIN ? fresh : FLT_MIN);
      const float old = bf16_to_f32(sc[d]);
      float scale = fresh;
      if (first > 0) {
        scale = old > fresh || old != old ? old : fresh; /* a NaN scale stays NaN, as torch.maximum keeps it */
        if (fresh > old) {
          const float ratio = old / scale;
          for (int64_t o = 0; o < first; ++o) {
            int8_t *qr = cache + (block * block_size + o) * row + h * D + d;
            float y = rintf((float)*qr * ratio);
            y = y > 127.f ? 127.f : (y < -127.f ? -127.f : y);
            *qr = (int8_t)y;
          }
        }
      }
      sc[d] = bf16_bits(scale);
      amax[d] = scale; /* from here on: the channel's scale */
    }
    for (int64_t t = t0; t < t1; ++t) {
      if (slots[t] < 0) continue;
      const scalar_t *xr = x + t * stride + h * D;
      int8_t *qr = cache + slots[t] * row + h * D;
      for (int64_t d = 0; d < D; ++d) {
        float y = rintf(load1(xr + d) / amax[d]);
        y = y > 127.f ? 127.f : (y < -127.f ? -127.f : y);
        qr[d] = (int8_t)y;
      }
    }
  }
}

/* The int8 cache write: token t's key and value rows go to slot slots[t] (negative: padding, skipped). Values
 * get one scale per row (v_scale [num_slots, num_kv_heads]); keys follow kv_quant.write_int8_keys per block
 * (k_scale, bfloat16 bits [num_blocks, num_kv_heads, head_dim]): the tokens of one block must be consecutive (padding aside),
 * as the engine writes them (a sequence's tokens in order), and each such run is quantized as one group.
 * Returns 0, or token + 1 of a slot outside the cache (then nothing is written). */
int64_t pagoda_reshape_and_cache_int8(const void *key, const void *value, void *k_cache, void *v_cache,
                                      uint16_t *k_scale, float *v_scale, const int64_t *slots, int64_t num_tokens,
                                      int64_t num_slots, int64_t block_size, int64_t num_kv_heads,
                                      int64_t head_dim, int64_t key_stride, int64_t value_stride) {
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slots[t] >= num_slots) return t + 1;
  const int64_t H = num_kv_heads, D = head_dim;
  const scalar_t *v = (const scalar_t *)value;
  int8_t *vc = (int8_t *)v_cache;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < H; ++h)
      v_scale[slots[t] * H + h] = quantize_row(v + t * value_stride + h * D, vc + (slots[t] * H + h) * D, D);
  }
  float amax[MAX_HEAD_DIM]; /* the caller keeps head_dim <= MAX_HEAD_DIM */
  int64_t t = 0;
  while (t < num_tokens) {
    if (slots[t] < 0) {
      ++t;
      continue;
    }
    const int64_t block = slots[t] / block_size;
    int64_t first = slots[t] % block_size, end = t + 1;
    for (; end < num_tokens; ++end) {
      if (slots[end] < 0) continue;
      if (slots[end] / block_size != block) break;
      if (slots[end] % block_size < first) first = slots[end] % block_size;
    }
    write_keys_int8((const scalar_t *)key, key_stride, slots, t, end, (int8_t *)k_cache, k_scale, block, first,
                    block_size, H, D, amax);
    t = end;
  }
  return 0;
}
#endif
