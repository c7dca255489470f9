/* Fused sampling on the CPU: temperature, min_p, top_k, top_p and a Gumbel-max draw in a few passes per row.
 *
 * The specification is pagoda/pagedkernel/sampling/torch_sampling.py; this file computes the same tokens,
 * bitwise, whatever the thread count. What makes that possible:
 * - exp32/log32 below are the exact operation sequences of sampling/fmath.py, and the library is compiled with
 *   -ffp-contract=off, so no multiply-add is fused and every operation rounds as torch's does;
 * - truncation masses are integers (trunc(e * 2^32)) summed in int64, exact in any order;
 * - every other step is a comparison: max, argmax (lowest index on ties), thresholds.
 *
 * Per sampled row (a row per OpenMP task; rows split into vocabulary slices when there are fewer rows than
 * threads):
 * 1. the max of the logits, its lowest index, NaN / +inf, and the 64-element chunk maxima (for top_k / top_p),
 *    with the logits prefetched 2 KB ahead. A row without min_p, top_k and top_p is drawn in this same pass.
 * 2. (only with top_k or top_p) thresholds on x = logits * (1/T), found without sorting the vocabulary: the
 *    k-th largest of the chunk maxima is a lower bound for the k-th largest logit, so only the elements above it
 *    are gathered and selected from (a quickselect over a few hundred values, usually; more than HIST_MIN
 *    candidates are first narrowed to one bucket of a histogram of x - m). For top_p one vectorised pass sums
 *    the kept mass W and builds the histogram of the masses within 16 nats of the maximum (`nucleus`); a second
 *    gathers the elements of the bucket where the cumulative mass reaches top_p * W, and a weighted quickselect
 *    over them finds the exact threshold.
 * 3. the Gumbel-max race: argmax of x - log(-log u) over the kept set. The score of an element is at most
 *    x + 24 ln 2 (u's 23 bits bound -log u from below), so elements more than 17 below the best score so far
 *    are skipped without hashing; the rest are gathered per chunk and hashed eight at a time, and a bound from
 *    the word alone (-log u >= 1 - u) rejects all but a handful before the two logs. The pruning is
 *    conservative, so the result is exactly the full argmax.
 *
 * Compiled by sampling/cpu_sampling.py with -DPAGODA_DTYPE=0 (float32), 1 (float16) or 2 (bfloat16).
 */
#include <math.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_dtype.h"
#include "cpu_gumbel.h"

/* Vectors of LANES floats: sixteen (one register) with AVX-512, eight (one register) otherwise; GCC splits wider
 * generic vectors badly on AVX2 (measured 10x slower). */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));
typedef uint64_t vq __attribute__((vector_size(4 * LANES)));
typedef float vfh __attribute__((vector_size(2 * LANES))); /* half a vf */
typedef double vd __attribute__((vector_size(4 * LANES)));  /* a vfh as doubles */

PAGODA_DEFINE_LOADV(loadv, vf, LANES)

#define CHUNK 64         /* elements per chunk maximum (the bounds of step 2) */
#define SLICE_ALIGN 64   /* vocabulary slices start at multiples of this (of LANES) */
#define MAX_THREADS 256
#define MIN_PARALLEL 65536 /* logits below which one thread does everything */
#define MIN_SLICE 16384    /* elements of the smallest vocabulary slice */
#define RACE_CHUNK (64 * LANES) /* elements the race gathers before hashing (a multiple of SLICE_ALIGN) */
#define MASS_SCALE 0x1p32f

enum { STATUS_OK = 0, STATUS_NONFINITE = 1, STATUS_NO_TOKEN = 2 };

/* ---- float32 math: the exact operation sequences of sampling/fmath.py ---- */

PAGODA_DEFINE_EXP32(expv, vf, vi) /* cpu_gumbel.h */

/* One exp32: the vector's operations on a broadcast, so scalar and vector results are the same bits. */
static inline float exp32(float x) { return expv((vf){0} + x)[0]; }

/* ---- vector helpers ---- */

static inline vf pick(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vi picki(vi m, vi a, vi b) { return (a & m) | (b & ~m); }

/* Bit l set when lane l of a comparison result is true (one instruction with AVX-512 or AVX2). */
static inline uint32_t mask_bits(vi m) {
#if defined(__AVX512F__)
  return (uint32_t)_mm512_test_epi32_mask((__m512i)m, (__m512i)m);
#elif defined(__AVX2__)
  return (uint32_t)_mm256_movemask_ps((__m256)m);
#else
  uint32_t bits = 0;
  for (int l = 0; l < LANES; ++l) bits |= (uint32_t)(m[l] & 1) << l;
  return bits;
#endif
}
static inline int any(vi m) { return mask_bits(m) != 0; }

/* LANES logits from i (lanes past n read as -inf). */
static inline vf load_tail(const scalar_t *row, int64_t i, int64_t n) {
  if (i + LANES <= n) return loadv(row + i);
  vf v;
  for (int l = 0; l < LANES; ++l) v[l] = i + l < n ? load1(row + i + l) : -INFINITY;
  return v;
}

/* ---- per-row state ---- */

typedef struct {
  float lmax;  /* max logit of the slice / row */
  int64_t arg; /* its lowest index */
  int bad;     /* a NaN or +inf logit */
  int any;     /* a logit above -inf */
  float best;  /* step 3: best score */
  int64_t best_i;
} slice_t;

typedef struct {
  float inv_t, m, min_p, cut; /* cut: kept tokens have x >= cut (top_k / top_p), -inf when neither is set */
  int64_t top_k;
  float top_p;
  uint64_t key;
  int status, greedy;
  int fused;    /* sampled without min_p, top_k or top_p: drawn during step 1, in one pass */
  int64_t arg;  /* the argmax: always kept */
  float s0;     /* its Gumbel score */
  float *cm;    /* [vocab / CHUNK] chunk maxima of the logits, written by step 1 for rows with top_k or top_p */
} row_t;

typedef struct {
  const scalar_t *logits;
  int64_t rows, vocab, stride, slices, slice_len;
} problem_t;

/* The Gumbel-max race of one slice: the best (score, lowest index) so far, and the bounds that skip elements.
 * Every element skipped provably scores below the best, so the race ends with the exact argmax. */
typedef struct {
  float best, slack, lo; /* lo: elements with x < lo cannot win (nor are they kept when below rw->cut) */
  int64_t best_i;
} race_t;

static inline void race_set(race_t *q, float best, int64_t best_i, float cut) {
  q->best = best, q->best_i = best_i;
  /* Margins cover the rounding of the bounds against the computed score (2 ulp logs, |best| up to ~1e6). */
  q->slack = best > -INFINITY ? 1e-3f + fabsf(best) * 1e-5f : 0.0f;
  q->lo = best > -INFINITY ? best - GUMBEL_SPAN - q->slack : -INFINITY;
  if (q->lo < cut) q->lo = cut;
}

/* Append the lanes of x that m selects (bit l: lane l), and their indices, to xs and at from n, in lane order;
 * the new count. Without a branch per lane (a lane near the best score is a coin flip on a flat row: a loop over
 * the set bits mispredicted its way to half the time of a T = 1 draw on the Zen 3): a compress with AVX-512, a
 * lane permutation with AVX2. Whole vectors are stored, so both arrays need LANES elements of room past n. */
static inline int64_t append_lanes(float *xs, int32_t *at, int64_t n, vf x, vi index, uint32_t m) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(xs + n, _mm512_maskz_compress_ps((__mmask16)m, (__m512)x));
  _mm512_storeu_si512(at + n, _mm512_maskz_compress_epi32((__mmask16)m, (__m512i)index));
#elif defined(__AVX2__)
  /* first[b]: the selected lanes of a 4-bit mask b as byte indices, lowest byte first */
  static const uint32_t first[16] = {0x0u,     0x0u,     0x1u,     0x100u,   0x2u,     0x200u,
                                     0x201u,   0x20100u, 0x3u,     0x300u,   0x301u,   0x30100u,
                                     0x302u,   0x30200u, 0x30201u, 0x3020100u};
  const int low = __builtin_popcount(m & 15u);
  /* the upper half's lanes (4-7) follow the lower half's; the bytes past the selected lanes are don't-cares */
  const uint64_t order = first[m & 15u] | (uint64_t)(first[m >> 4] + 0x04040404u) << (8 * low);
  const __m256i perm = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)order));
  _mm256_storeu_ps(xs + n, _mm256_permutevar8x32_ps((__m256)x, perm));
  _mm256_storeu_si256((__m256i *)(at + n), _mm256_permutevar8x32_epi32((__m256i)index, perm));
#else
  for (uint32_t b = m; b; b &= b - 1) {
    const int l = __builtin_ctz(b);
    xs[n] = x[l], at[n++] = index[l];
  }
  return n;
#endif
  return n + __builtin_popcount(m);
}

/* Enter the kept elements of logits [begin, end) (at most RACE_CHUNK of them, begin even) in the race. Few are
 * near enough to the best score to win on a peaked row (about 3% of a vocabulary of real logits at T = 1), half
 * or more on a flat one (Gemma 3's 262k logits after a random prompt): they are gathered first, then hashed eight
 * at a time, and a bound from each word rejects all but a handful before the two logs. */
static void race_chunk(race_t *q, const row_t *rw, const scalar_t *row, int64_t begin, int64_t end) {
  int32_t at[RACE_CHUNK + LANES];
  float xs[RACE_CHUNK + LANES];
  const float lo = q->lo; /* it only rises during the chunk: gathering with the first is conservative */
  vi lane;
  for (int l = 0; l < LANES; ++l) lane[l] = l;
  int64_t n = 0;
  for (int64_t b = 0; b * LANES < end - begin; ++b) {
    const vf x = load_tail(row, begin + b * LANES, end) * rw->inv_t;
    const uint32_t m = mask_bits((x >= lo) & (x > -INFINITY)); /* lanes past the end read -inf */
    n = append_lanes(xs, at, n, x, lane + (int32_t)(b * LANES), m);
  }
  for (int l = 0; l < 8; ++l) at[n + l] = 0, xs[n + l] = -INFINITY; /* the last group's unused lanes */
  typedef uint64_t v8q __attribute__((vector_size(64)));
  typedef uint32_t v8u __attribute__((vector_size(32)));
  typedef int32_t v8i __attribute__((vector_size(32)));
  typedef float v8f __attribute__((vector_size(32)));
  for (int64_t g = 0; g < n; g += 8) {
    v8i off;
    v8f x;
    memcpy(&off, at + g, sizeof off);
    memcpy(&x, xs + g, sizeof x);
    /* Word of index i: half i % 2 (low half first) of output i / 2 of the row's stream. */
    const v8q i = (v8q)__builtin_convertvector(off, v8q) + (uint64_t)begin;
    v8q z = rw->key + ((i >> 1) + 1) * GOLDEN;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const v8u words = __builtin_convertvector((z >> (32 * (i & 1))) & 0xffffffffu, v8u);
    /* -log u >= 1 - u = j / 2^24 with j = 2^24 - 2k - 1 >= 2^floor(log2 j), so the score is at most
     * x + (24 - floor(log2 j)) ln 2, floor(log2 j) read from the exponent of float(j) (exact: j < 2^24). */
    const v8i j = (int32_t)(1 << 24) - 2 * (v8i)(words >> 9) - 1;
    const v8i lg = ((v8i)__builtin_convertvector(j, v8f) >> 23) - 127;
    const v8i go = x + __builtin_convertvector(24 - lg, v8f) * 0.6932f >= q->best - q->slack; /* -inf: no */
#if defined(__AVX2__)
    uint32_t lanes = (uint32_t)_mm256_movemask_ps((__m256)go); /* usually none: one branch, not eight */
#else
    uint32_t lanes = 0;
    for (int l = 0; l < 8; ++l) lanes |= (uint32_t)(go[l] & 1) << l;
#endif
    for (; lanes; lanes &= lanes - 1) {
      const int l = __builtin_ctz(lanes);
      if (rw->min_p > 0.0f && !(exp32(x[l] - rw->m) >= rw->min_p)) continue;
      const float s = gumbel_score(x[l], words[l]);
      if (s > q->best || (s == q->best && (int64_t)i[l] < q->best_i)) race_set(q, s, (int64_t)i[l], rw->cut);
    }
  }
}

/* Step 1 over one slice: max, lowest argmax, NaN / +inf; for a fused row also the draw. */
static void scan_slice(const problem_t *p, int64_t r, const row_t *rw, int64_t begin, int64_t end, slice_t *out) {
  const scalar_t *row = p->logits + r * p->stride;
  vf mx = (vf){0} - INFINITY;
  vi idx = (vi){0} - 1, bad = (vi){0};
  vi iota;
  for (int l = 0; l < LANES; ++l) iota[l] = l;
  race_t q;
  race_set(&q, -INFINITY, -1, -INFINITY);
  vf chunk = (vf){0} - INFINITY;
  for (int64_t c0 = begin; c0 < end; c0 += RACE_CHUNK) {
    const int64_t c1 = c0 + RACE_CHUNK < end ? c0 + RACE_CHUNK : end;
    for (int64_t i = c0; i < c1; i += LANES) {
      /* Rows sit anywhere: ask for the logits 2 KB ahead, so the memory streams while the race computes. */
      __builtin_prefetch((const char *)(row + i) + 2048);
      const vf v = load_tail(row, i, end);
      if (rw->cm) { /* slices start at multiples of CHUNK */
        chunk = pick(v > chunk, v, chunk);
        if ((i + LANES) % CHUNK == 0 || i + LANES >= end) {
          float c = -INFINITY;
          for (int l = 0; l < LANES; ++l) c = chunk[l] > c ? chunk[l] : c;
          rw->cm[i / CHUNK] = c;
          chunk = (vf){0} - INFINITY;
        }
      }
      bad |= (v != v) | (v == INFINITY);
      const vi gt = v > mx; /* strictly greater: each lane keeps its first maximum */
      mx = pick(gt, v, mx);
      idx = picki(gt, iota + (int32_t)(i - begin), idx);
    }
    if (rw->fused) race_chunk(&q, rw, row, c0, c1); /* while the chunk is in L1 */
  }
  float m = -INFINITY;
  int64_t arg = -1;
  for (int l = 0; l < LANES; ++l) {
    if (idx[l] < 0) continue;
    const int64_t at = begin + idx[l];
    if (mx[l] > m || (mx[l] == m && at < arg)) m = mx[l], arg = at;
  }
  out->lmax = m;
  out->arg = arg;
  out->any = arg >= 0;
  out->bad = any(bad);
  out->best = q.best;
  out->best_i = q.best_i;
}

/* Weighted selection: the smallest value v among x[0..n) with above + (the weights of x > v) < limit, by a
 * quickselect with three-way partitions (x and w are reordered). The answer does not depend on the pivots. */
static float select_threshold(float *x, int64_t *w, int64_t n, double limit, int64_t above) {
  int64_t lo = 0, hi = n;
  float answer = INFINITY;
  while (lo < hi) {
    const float a = x[lo], b = x[lo + (hi - lo) / 2], c = x[hi - 1];
    const float pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
    /* [lo, gt) > pivot, [gt, i) == pivot, [lt, hi) < pivot */
    int64_t gt = lo, i = lo, lt = hi, sum_gt = 0, sum_eq = 0;
    while (i < lt) {
      if (x[i] > pivot) {
        const float tx = x[i];
        const int64_t tw = w[i];
        x[i] = x[gt], w[i] = w[gt];
        x[gt] = tx, w[gt] = tw;
        sum_gt += tw;
        ++gt, ++i;
      } else if (x[i] < pivot) {
        --lt;
        const float tx = x[i];
        const int64_t tw = w[i];
        x[i] = x[lt], w[i] = w[lt];
        x[lt] = tx, w[lt] = tw;
      } else {
        sum_eq += w[i];
        ++i;
      }
    }
    if ((double)(above + sum_gt) < limit) { /* the pivot qualifies: look for a smaller value */
      answer = pivot;
      above += sum_gt + sum_eq;
      lo = lt;
    } else { /* the answer is above the pivot */
      hi = gt;
    }
  }
  return answer;
}

/* Whether x passes min_p (e = exp32(x - m) >= min_p); min_p = 0 passes every finite x. */
static inline int min_p_keeps(const row_t *rw, float x) { return rw->min_p <= 0.0f || exp32(x - rw->m) >= rw->min_p; }

/* Histogram buckets of x by d = x - m, `scale` per nat from 0 down, everything past the last but one in the last:
 * HIST_SCALE spans the 23.2 nats where masses are not 0, HEAD_SCALE the 16 where top_p's threshold lies on any
 * row but a flat one sampled with top_p near 1. */
#define HIST_BUCKETS 512
#define HIST_SCALE 22.0f
#define HEAD_SCALE 32.0f
#define HIST_COPIES 4 /* lane l adds to copy l % HIST_COPIES */
#define HIST_MIN 4096 /* more candidates than this: a histogram pass narrows them to one bucket first */
static inline vf bucket_position(vf d, float scale) { return d * -scale; }
static inline vi bucketv(vf d, float scale) {
  const vf f = bucket_position(d, scale);
  return __builtin_convertvector(pick(f < (float)(HIST_BUCKETS - 1), f, (vf){0} + (HIST_BUCKETS - 1)), vi);
}

/* Truncation masses trunc(e * 2^32) as integer-valued floats: floats from 2^23 up are integers already, smaller
 * ones truncate through int32. */
static inline vf masses(vf e) {
  const vf f = e * MASS_SCALE;
  return pick(f < 0x1p23f, __builtin_convertvector(__builtin_convertvector(f, vi), vf), f);
}

/* The elements one selection runs over, and their weights. */
typedef struct {
  float above;   /* x > above, or x >= above when inclusive (a bound below which everything is dropped) */
  int inclusive;
  float tk;      /* x >= tk (top_k's threshold, for top_p) */
  int unit;      /* weights 1 (top_k); else masses trunc(e * 2^32), over x - m >= -23 only (top_p) */
  int bucket;    /* only histogram bucket `bucket`, or every bucket when -1 */
  float scale;   /* the histogram's buckets per nat */
} among_t;

enum { COUNT, HISTOGRAM, FILL };

/* The histogram of one selection's weights, in HIST_COPIES copies (summed into the first after the pass): a run of
 * elements in one bucket then adds to several sums, not to one in a chain of dependent additions (16 KB: in L1).
 * The selected elements' weights and buckets are first gathered, HIST_BATCH at a time, then added in one tight
 * loop. No counts: a bucket's elements are gathered into a buffer that grows. */
#define HIST_BATCH 1024
typedef struct {
  int64_t weight[HIST_COPIES * HIST_BUCKETS];
  float batch_weight[HIST_BATCH + LANES];
  int32_t batch_bucket[HIST_BATCH + LANES];
  int64_t batched;
} hist_t;

static void hist_flush(hist_t *h) {
  int64_t i = 0;
  for (; i + HIST_COPIES <= h->batched; i += HIST_COPIES)
    for (int c = 0; c < HIST_COPIES; ++c)
      h->weight[c * HIST_BUCKETS + h->batch_bucket[i + c]] += (int64_t)h->batch_weight[i + c];
  for (; i < h->batched; ++i) h->weight[h->batch_bucket[i]] += (int64_t)h->batch_weight[i];
  h->batched = 0;
}

/* Add the batch, then the copies into the first. */
static void hist_merge(hist_t *h) {
  hist_flush(h);
  for (int c = 1; c < HIST_COPIES; ++c)
    for (int j = 0; j < HIST_BUCKETS; ++j)
      h->weight[j] += h->weight[c * HIST_BUCKETS + j];
}

/* Selected elements and their weights, in buffers that grow; failed when memory ran out. */
typedef struct {
  float *x;
  int64_t *w;
  int64_t n, cap;
  int failed;
} fill_t;

static int fill_grow(fill_t *f) {
  const int64_t cap = 2 * f->cap + 1024;
  float *x = realloc(f->x, sizeof(float) * (size_t)cap);
  if (x) f->x = x;
  int64_t *w = realloc(f->w, sizeof(int64_t) * (size_t)cap);
  if (w) f->w = w;
  if (!x || !w) return !(f->failed = 1);
  f->cap = cap;
  return 1;
}

/* One pass over the row's selected elements, in the chunks whose maximum (cm, as x) can pass `above`. COUNT: how
 * many, ignoring min_p (an upper bound); HISTOGRAM: add each weight to hist; FILL: append (x, weight) to fill.
 * Returns the count (FILL: stops early when memory runs out). */
static int64_t visit(const problem_t *p, int64_t r, const row_t *rw, const float *cm, const among_t *among, int mode,
                     hist_t *hist, fill_t *fill) {
  const scalar_t *row = p->logits + r * p->stride;
  /* Copies: the stores below could alias the fields, which would be loaded again for every vector otherwise. */
  const among_t a = *among;
  const float inv_t = rw->inv_t, min_p = rw->min_p;
  const vf vm = (vf){0} + rw->m;
  const int exact = mode != COUNT && (min_p > 0.0f || !a.unit);
  const int64_t nchunks = (p->vocab + CHUNK - 1) / CHUNK;
  int64_t n = 0;
  for (int64_t c = 0; c < nchunks; ++c) {
    if (a.inclusive ? !(cm[c] >= a.above) : !(cm[c] > a.above)) continue;
    const int64_t end = (c + 1) * CHUNK < p->vocab ? (c + 1) * CHUNK : p->vocab;
    for (int64_t i = c * CHUNK; i < end; i += LANES) {
      const vf x = load_tail(row, i, end) * inv_t;
      const vf d = x - vm;
      vi in = (a.inclusive ? x >= a.above : x > a.above) & (x >= a.tk) & (x > -INFINITY);
      if (!a.unit) in &= d >= -23.0f;
      if (!any(in)) continue;
      if (a.bucket >= 0 && !any(in &= bucketv(d, a.scale) == a.bucket)) continue; /* most vectors: no exp */
      vf mass = (vf){0} + 1.0f;
      if (exact) {
        const vf e = expv(d);
        if (min_p > 0.0f) in &= e >= min_p;
        if (!a.unit) mass = e * MASS_SCALE;
      }
      const uint32_t bits = mask_bits(in);
      if (!bits) continue;
      if (mode == COUNT) {
        n += __builtin_popcount(bits);
        continue;
      }
      if (mode == HISTOGRAM) {
        if (hist->batched > HIST_BATCH) hist_flush(hist);
        hist->batched =
            append_lanes(hist->batch_weight, hist->batch_bucket, hist->batched, mass, bucketv(d, a.scale), bits);
        n += __builtin_popcount(bits);
        continue;
      }
      for (uint32_t m = bits; m; m &= m - 1) {
        if (fill->n == fill->cap && !fill_grow(fill)) return n;
        const int l = __builtin_ctz(m);
        fill->x[fill->n] = x[l], fill->w[fill->n++] = (int64_t)mass[l];
        ++n;
      }
    }
  }
  return n;
}

/* The histogram of a selection (a->bucket -1), its copies summed into the first; NULL when out of memory. */
static hist_t *histogram(const problem_t *p, int64_t r, const row_t *rw, const float *cm, const among_t *a) {
  hist_t *hist = calloc(1, sizeof(hist_t));
  if (!hist) return NULL;
  visit(p, r, rw, cm, a, HISTOGRAM, hist, NULL);
  hist_merge(hist);
  return hist;
}

/* The bucket holding the threshold: buckets are intervals of x, in decreasing order, so the threshold lies in the
 * first bucket where the weight of it and the buckets before it reaches limit; everything before it is kept (their
 * weight is *above), everything after dropped. When no bucket reaches limit, every element qualifies: the
 * threshold is the minimum, in the last bucket holding any (only with unit weights, top_k's: top_p's limit is
 * below the weight of the buckets, which hold its bound's mass or more). */
static int threshold_bucket(const hist_t *hist, double limit, int64_t *above) {
  int j = 0, last = 0;
  int64_t sum = 0, before_last = 0;
  for (; j < HIST_BUCKETS && (double)(sum + hist->weight[j]) < limit; sum += hist->weight[j++])
    if (hist->weight[j]) last = j, before_last = sum;
  if (j == HIST_BUCKETS) j = last, sum = before_last;
  *above = sum;
  return j;
}

/* The weighted selection over a selection's elements (of bucket a->bucket unless -1; about n of them), with
 * `above` the weight of those above them. Sets *failed when out of memory. */
static float select_filled(const problem_t *p, int64_t r, const row_t *rw, const float *cm, const among_t *a,
                           int64_t n, double limit, int64_t above, int *failed) {
  fill_t f = {malloc(sizeof(float) * (size_t)(n ? n : 1)), malloc(sizeof(int64_t) * (size_t)(n ? n : 1)), 0, n, 0};
  float t = INFINITY;
  if (f.x && f.w) visit(p, r, rw, cm, a, FILL, NULL, &f);
  if (!f.x || !f.w || f.failed) *failed = 1;
  else t = select_threshold(f.x, f.w, f.n, limit, above);
  free(f.x), free(f.w);
  return t;
}

/* The threshold of one selection: the smallest selected x whose selected weight above is < limit. Sets *failed
 * when out of memory. */
static float select_among(const problem_t *p, int64_t r, const row_t *rw, const float *cm, among_t a, double limit,
                          int *failed) {
  int64_t n = visit(p, r, rw, cm, &a, COUNT, NULL, NULL), above = 0;
  if (n > HIST_MIN) {
    hist_t *hist = histogram(p, r, rw, cm, &a);
    if (!hist) return *failed = 1, INFINITY;
    a.bucket = threshold_bucket(hist, limit, &above);
    n = 1024; /* a first guess: the buffer grows */
    free(hist);
  }
  return select_filled(p, r, rw, cm, &a, n, limit, above, failed);
}

/* top_p's threshold for row r, given top_k's tk (-inf without) and the chunk maxima as x (ax, aw: room for as
 * many). One pass sums the kept mass W (tokens with x - m < -23 have exp < 2^-32, mass 0: skipped, and dropped,
 * since everything at or below them has mass 0 too, so the kept mass above them is W >= top_p * W) and builds the
 * histogram of the kept masses of the head, d = x - m above -16 (HEAD_SCALE). Where the head's mass reaches
 * limit = top_p * W, the threshold lies in the bucket where the head's cumulative weight does, and a second pass
 * that computes exp only where an element falls in that bucket gathers its few for the weighted selection. A
 * flat row sampled with top_p near 1 puts the threshold below the head: then the selection narrows the row the
 * slower way (chunk-maxima bound, count, histogram over 23.2 nats). Sets *failed when out of memory. */
static float nucleus(const problem_t *p, int64_t r, const row_t *rw, const float *cm, float tk, float *ax,
                     int64_t *aw, int *failed) {
  const scalar_t *row = p->logits + r * p->stride;
  const int64_t V = p->vocab, nchunks = (V + CHUNK - 1) / CHUNK;
  hist_t *hist = calloc(1, sizeof(hist_t));
  if (!hist) return *failed = 1, INFINITY;
  const vf vm = (vf){0} + rw->m;
  /* The tail's masses (d <= -511 / 32: below e^-15.96 * 2^32 < 512 each) add exactly in float lanes for 32768
   * vectors (sums up to 2^24), then go to a double. */
  double tail_total = 0.0;
  vf tail = (vf){0};
  for (int64_t i = 0, block = 0; i < V; i += LANES) {
    if (++block == 32768) {
      for (int l = 0; l < LANES; ++l) tail_total += tail[l];
      tail = (vf){0}, block = 0;
    }
    const vf x = load_tail(row, i, V) * rw->inv_t;
    const vf d = x - vm;
    vi in = (x >= tk) & (d >= -23.0f);
    if (!any(in)) continue;
    const vf e = expv(d);
    if (rw->min_p > 0.0f) in &= e >= rw->min_p;
    const vf t = masses(e), f = bucket_position(d, HEAD_SCALE);
    const vi head = f < (float)(HIST_BUCKETS - 1); /* buckets 0 .. HIST_BUCKETS - 2 */
    tail += (vf)((vi)t & in & ~head);
    const uint32_t bits = mask_bits(in & head);
    if (!bits) continue;
    if (hist->batched > HIST_BATCH) hist_flush(hist);
    hist->batched = append_lanes(hist->batch_weight, hist->batch_bucket, hist->batched, t,
                                 __builtin_convertvector(f, vi), bits);
  }
  for (int l = 0; l < LANES; ++l) tail_total += tail[l];
  hist_merge(hist);
  int64_t head = 0, above = 0;
  for (int j = 0; j < HIST_BUCKETS; ++j) head += hist->weight[j];
  const double limit = (double)rw->top_p * ((double)head + tail_total); /* both exact: below 2^53 */
  if ((double)head >= limit) {
    const int j = threshold_bucket(hist, limit, &above);
    free(hist);
    /* Chunks whose maximum lies below the bucket hold none of it (d > -(j + 1) / HEAD_SCALE, with room for the
     * rounding of d and of the bound). */
    const float edge = rw->m - (float)(j + 1) / HEAD_SCALE - (1e-3f + 1e-5f * fabsf(rw->m));
    const among_t a = {edge, 0, tk, 0, j, HEAD_SCALE};
    return select_filled(p, r, rw, cm, &a, 1024, limit, above, failed);
  }
  free(hist);
  /* A lower bound from the kept chunk maxima: the largest of their values whose chunk-maxima mass above is >=
   * limit has a true mass above >= limit too, so it and everything below it are dropped. */
  int64_t na = 0;
  for (int64_t c = 0; c < nchunks; ++c) {
    const float x = cm[c];
    if (x > -INFINITY && x >= tk && min_p_keeps(rw, x)) ax[na] = x, aw[na++] = (int64_t)(exp32(x - rw->m) * MASS_SCALE);
  }
  const float t_cm = select_threshold(ax, aw, na, limit, 0);
  float bound = -INFINITY;
  for (int64_t c = 0; c < na; ++c)
    if (ax[c] < t_cm && ax[c] > bound) bound = ax[c];
  return select_among(p, r, rw, cm, (among_t){bound, 0, tk, 0, -1, HIST_SCALE}, limit, failed);
}

/* Step 2 for one sampled row: rw->cut. Returns 0, or 1 when out of memory. */
static int thresholds(const problem_t *p, int64_t r, row_t *rw) {
  const int64_t V = p->vocab, nchunks = (V + CHUNK - 1) / CHUNK;
  const int use_k = rw->top_k > 0 && rw->top_k < V, use_p = rw->top_p < 1.0f;
  rw->cut = -INFINITY;
  if (!use_k && !use_p) return 0;
  /* Chunk maxima as x (x = l * inv_t is monotone in l). */
  float *cm = malloc(sizeof(float) * (size_t)nchunks), *ax = malloc(sizeof(float) * (size_t)nchunks);
  int64_t *aw = malloc(sizeof(int64_t) * (size_t)nchunks);
  int failed = !cm || !ax || !aw;
  if (failed) goto done;
  for (int64_t c = 0; c < nchunks; ++c) cm[c] = rw->cm[c] * rw->inv_t;
  float tk = -INFINITY;
  if (use_k) {
    /* The chunk maxima min_p keeps are distinct candidates: their k-th largest bounds the k-th largest. Fewer
     * than k elements above the bound (none when it is -inf) give their minimum: every candidate kept. */
    int64_t na = 0;
    for (int64_t c = 0; c < nchunks; ++c)
      if (cm[c] > -INFINITY && min_p_keeps(rw, cm[c])) ax[na] = cm[c], aw[na++] = 1;
    const double k = (double)rw->top_k;
    const float bound = na >= rw->top_k ? select_threshold(ax, aw, na, k, 0) : -INFINITY;
    tk = select_among(p, r, rw, cm, (among_t){bound, 1, -INFINITY, 1, -1, HIST_SCALE}, k, &failed);
  }
  float tp = -INFINITY;
  if (use_p && !failed) tp = nucleus(p, r, rw, cm, tk, ax, aw, &failed);
  rw->cut = tk > tp ? tk : tp;
done:
  free(cm), free(ax), free(aw);
  return failed;
}

/* Step 3 over one slice: the race over the kept tokens, starting from the row's argmax. */
static void draw_slice(const problem_t *p, int64_t r, const row_t *rw, int64_t begin, int64_t end, slice_t *out) {
  const scalar_t *row = p->logits + r * p->stride;
  race_t q;
  race_set(&q, rw->s0, rw->arg, rw->cut);
  for (int64_t i = begin; i < end; i += RACE_CHUNK) race_chunk(&q, rw, row, i, i + RACE_CHUNK < end ? i + RACE_CHUNK : end);
  out->best = q.best;
  out->best_i = q.best_i;
}

/* Steps 1 and 2 finished for row r: its status, max, argmax and thresholds (0, or 1 when out of memory). */
static int prepare_row(const problem_t *p, int64_t r, const slice_t *slices, row_t *rw) {
  float lmax = -INFINITY;
  int64_t arg = -1;
  int bad = 0;
  for (int64_t s = 0; s < p->slices; ++s) {
    const slice_t *sl = &slices[r * p->slices + s];
    bad |= sl->bad;
    if (sl->any && (sl->lmax > lmax || (sl->lmax == lmax && sl->arg < arg))) lmax = sl->lmax, arg = sl->arg;
  }
  rw->arg = arg < 0 ? 0 : arg;
  if (bad) rw->status = STATUS_NONFINITE;
  else if (arg < 0) rw->status = STATUS_NO_TOKEN;
  else rw->status = STATUS_OK;
  if (rw->status != STATUS_OK || rw->greedy) return 0;
  rw->m = lmax * rw->inv_t;
  if (rw->m == INFINITY) { /* finite logits overflowing after 1/T */
    rw->status = STATUS_NONFINITE;
    return 0;
  }
  if (rw->fused) return 0; /* drawn in step 1 already */
  rw->s0 = gumbel_score(rw->m, word_at(rw->key, arg));
  return thresholds(p, r, rw);
}

/* The kept mask of one row (the tokens it can draw), for the tests: one-hot for greedy rows, empty for bad rows. */
static void write_mask(const problem_t *p, int64_t r, const row_t *rw, uint8_t *mask) {
  const scalar_t *row = p->logits + r * p->stride;
  uint8_t *out = mask + r * p->vocab;
  memset(out, 0, (size_t)p->vocab);
  if (rw->status != STATUS_OK) return;
  if (rw->greedy) {
    out[rw->arg] = 1;
    return;
  }
  for (int64_t i = 0; i < p->vocab; ++i) {
    const float x = load1(row + i) * rw->inv_t;
    out[i] = x > -INFINITY && x >= rw->cut && min_p_keeps(rw, x);
  }
}

/* Row r's token (the best of its slices' draws) and status, and its mask when asked for. */
static void finish_row(const problem_t *p, int64_t r, const row_t *rw, const slice_t *sl, int64_t *tokens,
                       int32_t *status, uint8_t *mask) {
  status[r] = rw->status;
  tokens[r] = rw->status == STATUS_OK ? rw->arg : 0;
  if (rw->status == STATUS_OK && !rw->greedy) {
    float best = -INFINITY;
    int64_t best_i = 0;
    for (int64_t s = 0; s < p->slices; ++s) {
      const slice_t *x = &sl[r * p->slices + s];
      if (x->best > best || (x->best == best && x->best_i < best_i)) best = x->best, best_i = x->best_i;
    }
    tokens[r] = best_i;
  }
  if (mask) write_mask(p, r, rw, mask);
}

/* One token per row of logits [rows, vocab] (rows `stride` elements apart). inv_temperature 0 is greedy;
 * top_k 0 and top_p 1 disable those. Writes tokens and status (0 ok, 1 NaN or +inf, 2 every logit -inf; token 0
 * then), and the kept mask [rows, vocab] when `mask` is not NULL. Returns 0, 1 for bad sizes, 2 when out of memory. */
int pagoda_sample(const void *logits, int64_t rows, int64_t vocab, int64_t stride, const float *inv_temperature,
                  const int64_t *top_k, const float *top_p, const float *min_p, const int64_t *keys,
                  int64_t *tokens, int32_t *status, uint8_t *mask, int64_t num_threads) {
  if (rows < 0 || vocab < 1 || stride < vocab) return 1;
  if (rows == 0) return 0;
  if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
  if (rows * vocab < MIN_PARALLEL || num_threads < 1) num_threads = 1; /* waking threads would cost more */
  /* Rows split into vocabulary slices when there are fewer rows than threads, so a single row uses them all;
   * a slice is at least MIN_SLICE elements. */
  int64_t slices = rows >= num_threads ? 1 : (2 * num_threads + rows - 1) / rows;
  if (slices > vocab / MIN_SLICE) slices = vocab / MIN_SLICE > 1 ? vocab / MIN_SLICE : 1;
  int64_t slice_len = (vocab + slices - 1) / slices;
  slice_len = (slice_len + SLICE_ALIGN - 1) / SLICE_ALIGN * SLICE_ALIGN;
  slices = (vocab + slice_len - 1) / slice_len;
  const problem_t p = {(const scalar_t *)logits, rows, vocab, stride, slices, slice_len};
  slice_t *sl = malloc(sizeof(slice_t) * (size_t)(rows * slices));
  row_t *rw = malloc(sizeof(row_t) * (size_t)rows);
  if (!sl || !rw) {
    free(sl), free(rw);
    return 2;
  }
  for (int64_t r = 0; r < rows; ++r) {
    rw[r] = (row_t){.inv_t = inv_temperature[r], .min_p = min_p[r], .top_k = top_k[r], .top_p = top_p[r],
                    .key = (uint64_t)keys[r], .greedy = inv_temperature[r] == 0.0f, .cut = -INFINITY};
    rw[r].fused = !rw[r].greedy && min_p[r] <= 0.0f && (top_k[r] <= 0 || top_k[r] >= vocab) && top_p[r] >= 1.0f;
  }
  /* Chunk maxima for the rows that set top_k or top_p. */
  const int64_t nchunks = (vocab + CHUNK - 1) / CHUNK;
  int64_t need = 0;
  for (int64_t r = 0; r < rows; ++r)
    need += !rw[r].greedy && !rw[r].fused && ((top_k[r] > 0 && top_k[r] < vocab) || top_p[r] < 1.0f);
  float *cms = need ? malloc(sizeof(float) * (size_t)(need * nchunks)) : NULL;
  if (need && !cms) {
    free(sl), free(rw);
    return 2;
  }
  for (int64_t r = 0, j = 0; r < rows; ++r)
    if (!rw[r].greedy && !rw[r].fused && ((top_k[r] > 0 && top_k[r] < vocab) || top_p[r] < 1.0f))
      rw[r].cm = cms + nchunks * j++;
  const int64_t items = rows * slices;
  int oom = 0;
  if (slices == 1) { /* a row per task: its later passes read it from this core's cache */
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) reduction(| : oom)
    for (int64_t r = 0; r < rows; ++r) {
      scan_slice(&p, r, &rw[r], 0, vocab, &sl[r]);
      oom |= prepare_row(&p, r, sl, &rw[r]);
      if (rw[r].status == STATUS_OK && !rw[r].greedy && !rw[r].fused) draw_slice(&p, r, &rw[r], 0, vocab, &sl[r]);
      finish_row(&p, r, &rw[r], sl, tokens, status, mask);
    }
    free(sl), free(rw), free(cms);
    return oom ? 2 : 0;
  }
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t r = it / slices, b = it % slices * slice_len;
      scan_slice(&p, r, &rw[r], b, b + slice_len < vocab ? b + slice_len : vocab, &sl[it]);
    }
#pragma omp for schedule(dynamic, 1) reduction(| : oom)
    for (int64_t r = 0; r < rows; ++r) oom |= prepare_row(&p, r, sl, &rw[r]);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t r = it / slices, b = it % slices * slice_len;
      if (rw[r].status == STATUS_OK && !rw[r].greedy && !rw[r].fused)
        draw_slice(&p, r, &rw[r], b, b + slice_len < vocab ? b + slice_len : vocab, &sl[it]);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) finish_row(&p, r, &rw[r], sl, tokens, status, mask);
  }
  free(sl), free(rw), free(cms);
  return oom ? 2 : 0;
}
