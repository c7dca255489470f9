/* Batched multi-LoRA on the CPU: every row of a flat batch gathers its own adapter's A and B by a slot index.
 *
 * The specification is pagoda/pagedkernel/lora/torch_lora.py:
 *   shrink: h[t, r] = scales[s] * sum_k x[t, k] * a[s, r, k]           (s = slots[t]; h is float32)
 *   expand: y[t, offset + n] = y[t, offset + n] + sum_r h[t, r] * b[s, n, r]   (summed in float32, rounded once)
 * B may be output-major (b[s, n, r] contiguous) or rank-major (a transposed [slots, rank, out] pool, whose
 * expand is vectorized over outputs); the embedding's shrink is a gather (pagoda_lora_embedding_shrink).
 * A row whose slot is negative has no adapter: shrink writes its h row as 0 and does no product, expand does not
 * touch it. Every slot is checked against num_slots before anything is written (status 1: out of range).
 * x, a, b and y share the storage dtype of -DPAGODA_DTYPE (cpu_dtype.h); every product is accumulated in float32,
 * eight lanes at a time. Work items (rows for shrink, row x column tiles for expand) are split over torch's
 * OpenMP pool when built with -fopenmp and the call is large enough (PARALLEL_MIN_WORK); each output is computed whole by one thread, so the result does not
 * depend on the thread count.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_dtype.h"

typedef float v8f __attribute__((vector_size(32)));
PAGODA_DEFINE_LOADV(loadv8, v8f, 8)

#define EXPAND_TILE 64 /* output columns per expand work item */
/* Below this many multiply-adds a call runs on one thread: a decode batch's delta is microseconds of work, and
 * an OpenMP region costs more than that when a core of a loaded machine is taken (its barrier waits). */
#define PARALLEL_MIN_WORK (1 << 21)

static int check_slots(const int64_t *slots, int64_t rows, int64_t num_slots) {
  for (int64_t t = 0; t < rows; t++)
    if (slots[t] >= num_slots) return 1;
  return 0;
}

/* sum_i p[i] * q[i] in float32: four independent eight-lane accumulators (one would wait on each add's latency),
 * then eight lanes, then the tail (the same order for every row). */
static inline float dot(const scalar_t *p, const scalar_t *q, int64_t n) {
  v8f acc = {0, 0, 0, 0, 0, 0, 0, 0}, acc1 = acc, acc2 = acc, acc3 = acc;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc += loadv8(p + i) * loadv8(q + i);
    acc1 += loadv8(p + i + 8) * loadv8(q + i + 8);
    acc2 += loadv8(p + i + 16) * loadv8(q + i + 16);
    acc3 += loadv8(p + i + 24) * loadv8(q + i + 24);
  }
  acc = (acc + acc1) + (acc2 + acc3);
  for (; i + 8 <= n; i += 8) acc += loadv8(p + i) * loadv8(q + i);
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; i++) sum += load1(p + i) * load1(q + i);
  return sum;
}

/* sum_i h[i] * q[i] with h in float32 (expand's h row) and q in the storage dtype (a row of B), eight lanes at a
 * time: B rows are rank-long and contiguous, so each output is one short vector dot instead of a scalar chain. */
static inline float dot_h(const float *h, const scalar_t *q, int64_t n) {
  v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8f hv;
    memcpy(&hv, h + i, sizeof hv);
    acc += hv * loadv8(q + i);
  }
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; i++) sum += h[i] * load1(q + i);
  return sum;
}

int pagoda_lora_shrink(const scalar_t *x, int64_t x_stride, const scalar_t *a, const int64_t *slots,
                       const float *scales, int64_t rows, int64_t rank, int64_t in_features, int64_t num_slots,
                       float *h, int64_t num_threads) {
  if (check_slots(slots, rows, num_slots)) return 1;
  const int parallel = rows * rank * in_features >= PARALLEL_MIN_WORK;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
  for (int64_t t = 0; t < rows; t++) {
    float *out = h + t * rank;
    const int64_t s = slots[t];
    if (s < 0) {
      for (int64_t r = 0; r < rank; r++) out[r] = 0.0f;
      continue;
    }
    const scalar_t *xt = x + t * x_stride;
    const scalar_t *as = a + s * rank * in_features;
    for (int64_t r = 0; r < rank; r++) out[r] = scales[s] * dot(xt, as + r * in_features, in_features);
  }
  return 0;
}

/* One row's expand over outputs [first, last) of a B laid out rank-major (b[r * out_features + n], the pool's
 * layout): every rank's h times a contiguous run of B, accumulated for EXPAND_TILE outputs in eight-lane vectors,
 * then added to y once. No horizontal sums: this is the fast path (a decode step's delta is mostly this loop). */
static void expand_rank_major(const float *ht, const scalar_t *bs, int64_t out_features, int64_t rank,
                              int64_t first, int64_t last, scalar_t *yt) {
  if (last - first == EXPAND_TILE) { /* a whole tile: constant bounds, so the accumulators live in registers */
    v8f acc[EXPAND_TILE / 8] = {{0}};
    for (int64_t r = 0; r < rank; r++) {
      const v8f hr = (v8f){0, 0, 0, 0, 0, 0, 0, 0} + ht[r];
      const scalar_t *row = bs + r * out_features + first;
      for (int v = 0; v < EXPAND_TILE / 8; v++) acc[v] += hr * loadv8(row + 8 * v);
    }
    for (int v = 0; v < EXPAND_TILE / 8; v++)
      for (int i = 0; i < 8; i++) yt[first + 8 * v + i] = store1(load1(yt + first + 8 * v + i) + acc[v][i]);
    return;
  }
  v8f acc[EXPAND_TILE / 8];
  const int64_t full = first + (last - first) / 8 * 8;
  for (int64_t v = 0; v < EXPAND_TILE / 8; v++) acc[v] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
  float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t r = 0; r < rank; r++) {
    const float hr = ht[r];
    const scalar_t *row = bs + r * out_features;
    for (int64_t n = first, v = 0; n < full; n += 8, v++) acc[v] += hr * loadv8(row + n);
    for (int64_t n = full; n < last; n++) tail[n - full] += hr * load1(row + n);
  }
  for (int64_t n = first, v = 0; n < full; n += 8, v++)
    for (int64_t i = 0; i < 8; i++) yt[n + i] = store1(load1(yt + n + i) + acc[v][i]);
  for (int64_t n = full; n < last; n++) yt[n] = store1(load1(yt + n) + tail[n - full]);
}

/* b_stride_n / b_stride_r: B's element strides over outputs and ranks within a slot (slots are out * rank apart);
 * rank-major (b_stride_n == 1) takes the vectorized path, output-major (b_stride_r == 1) one dot per output. */
int pagoda_lora_expand(const float *h, const scalar_t *b, const int64_t *slots, int64_t rows, int64_t out_features,
                       int64_t rank, int64_t num_slots, scalar_t *y, int64_t y_stride, int64_t offset,
                       int64_t num_threads, int64_t b_stride_n, int64_t b_stride_r) {
  if (check_slots(slots, rows, num_slots)) return 1;
  if (!((b_stride_n == 1 && b_stride_r == out_features) || (b_stride_r == 1 && b_stride_n == rank))) return 3;
  const int64_t tiles = (out_features + EXPAND_TILE - 1) / EXPAND_TILE;
  const int parallel = rows * out_features * rank >= PARALLEL_MIN_WORK;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
  for (int64_t item = 0; item < rows * tiles; item++) {
    /* Tiles outer, rows inner: a tile of each slot's B (rank x 64 outputs) stays in L1 across the rows. */
    const int64_t t = item % rows;
    const int64_t s = slots[t];
    if (s < 0) continue;
    const int64_t first = (item / rows) * EXPAND_TILE;
    const int64_t last = first + EXPAND_TILE < out_features ? first + EXPAND_TILE : out_features;
    const float *ht = h + t * rank;
    const scalar_t *bs = b + s * out_features * rank;
    scalar_t *yt = y + t * y_stride + offset;
    if (b_stride_n == 1) {
      expand_rank_major(ht, bs, out_features, rank, first, last, yt);
    } else {
      for (int64_t n = first; n < last; n++) yt[n] = store1(load1(yt + n) + dot_h(ht, bs + n * rank, rank));
    }
  }
  return 0;
}

/* The embedding's shrink, a gather: h[t, r] = scales[s] * a[s, ids[t], r] (a is A transposed, [slots, vocab, rank]),
 * 0 for rows without an adapter. Every slot and, for rows with an adapter, every id is checked first (status 1:
 * a slot out of range, 2: an id out of range). rows x rank loads: never worth a thread team. */
int pagoda_lora_embedding_shrink(const int64_t *ids, const scalar_t *a, const int64_t *slots, const float *scales,
                                 int64_t rows, int64_t rank, int64_t vocab, int64_t num_slots, float *h) {
  if (check_slots(slots, rows, num_slots)) return 1;
  for (int64_t t = 0; t < rows; t++)
    if (slots[t] >= 0 && (ids[t] < 0 || ids[t] >= vocab)) return 2;
  for (int64_t t = 0; t < rows; t++) {
    float *out = h + t * rank;
    const int64_t s = slots[t];
    if (s < 0) {
      for (int64_t r = 0; r < rank; r++) out[r] = 0.0f;
      continue;
    }
    const scalar_t *row = a + (s * vocab + ids[t]) * rank;
    for (int64_t r = 0; r < rank; r++) out[r] = scales[s] * load1(row + r);
  }
  return 0;
}

/* A whole LoRA layer in one call (what a hooked Linear needs each step): for every row with an adapter, h = x A^T
 * over all shards (rank rows each), then each used shard's y columns += h_shard B_shard^T, B rank-major
 * ([slots, rank, n_i], the pool's layout). `used[i]` == 0 skips shard i (no loaded slot adapts it). One call and
 * no h tensor instead of a shrink and an expand per shard: at decode sizes the calls, not the math, dominated.
 *
 * Rows are grouped by slot (a counting sort), so that each row of A and each tile of B is read and converted once
 * per slot and block of APPLY_ROWS rows, not once per row; the products are register-blocked over those rows in
 * sixteen-lane vectors (x converted to float32 once), and y is rounded and stored sixteen lanes at a time. Two
 * phases, each split over torch's OpenMP pool once the call is large enough (APPLY_PARALLEL_MIN_WORK): the
 * shrinks by (slot, row block), then the expands by (slot, shard, tile of EXPAND_TILE outputs). Every output is
 * computed whole, in one fixed order, by one thread: the result depends neither on the thread count nor on how
 * the rows are grouped. A bfloat16 build on AVX512-BF16 multiplies x and A in bfloat16 pairs summed in float32
 * (shrink_rows_bf16). Status 2: out of memory for the buffers. */
typedef float v16f __attribute__((vector_size(64)));
PAGODA_DEFINE_LOADV(loadv16, v16f, 16)

#define APPLY_ROWS 4 /* rows sharing each load of A and B */
#define PREFETCH_TILES 4 /* how many tiles ahead the expand prefetches B */
/* Below this many multiply-adds the layer runs on one thread (an OpenMP region costs a few microseconds; a
 * decode batch's smallest projection is ~10 us of work, so two cores halve the larger ones). */
#define APPLY_PARALLEL_MIN_WORK (1 << 17)

static inline float hsum16(v16f v) {
  float s = 0.0f;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
}

PAGODA_DEFINE_STOREV(store16, v16f, 16)

/* y[0..16) = round(y + acc): store1(load1(y) + acc) sixteen lanes at a time (the same rounding, bit for bit). */
static inline void add_store16(scalar_t *y, v16f acc) { store16(y, loadv16(y) + acc); }

/* h[g * h_stride + j] = xf[g] . a[j] for nr (<= APPLY_ROWS) float32 rows xf[g] and na rows of a (in_features
 * long): two rows of A at a time against every row, one sixteen-lane accumulator per pair, then the tail. */
static inline __attribute__((always_inline)) void shrink_rows(const float *const *xf, const int nr, const scalar_t *a,
                                                               int64_t na, int64_t in_features, float *h,
                                                               int64_t h_stride) {
  const int64_t full = in_features / 16 * 16;
  int64_t j = 0;
  for (; j + 2 <= na; j += 2) {
    const scalar_t *a0 = a + j * in_features, *a1 = a0 + in_features;
    v16f acc0[APPLY_ROWS], acc1[APPLY_ROWS];
    for (int g = 0; g < nr; g++) acc0[g] = acc1[g] = (v16f){0};
    for (int64_t k = 0; k < full; k += 16) {
      const v16f va0 = loadv16(a0 + k), va1 = loadv16(a1 + k);
      for (int g = 0; g < nr; g++) {
        v16f xv;
        memcpy(&xv, xf[g] + k, sizeof xv);
        acc0[g] += xv * va0;
        acc1[g] += xv * va1;
      }
    }
    for (int g = 0; g < nr; g++) {
      float s0 = hsum16(acc0[g]), s1 = hsum16(acc1[g]);
      for (int64_t k = full; k < in_features; k++) {
        s0 += xf[g][k] * load1(a0 + k);
        s1 += xf[g][k] * load1(a1 + k);
      }
      h[g * h_stride + j] = s0;
      h[g * h_stride + j + 1] = s1;
    }
  }
  for (; j < na; j++) { /* an odd count of A rows (the same per-row order as the pairs above) */
    const scalar_t *a0 = a + j * in_features;
    v16f acc0[APPLY_ROWS];
    for (int g = 0; g < nr; g++) acc0[g] = (v16f){0};
    for (int64_t k = 0; k < full; k += 16) {
      const v16f va0 = loadv16(a0 + k);
      for (int g = 0; g < nr; g++) {
        v16f xv;
        memcpy(&xv, xf[g] + k, sizeof xv);
        acc0[g] += xv * va0;
      }
    }
    for (int g = 0; g < nr; g++) {
      float s0 = hsum16(acc0[g]);
      for (int64_t k = full; k < in_features; k++) s0 += xf[g][k] * load1(a0 + k);
      h[g * h_stride + j] = s0;
    }
  }
}

#if PAGODA_DTYPE == PAGODA_BFLOAT16 && defined(__AVX512BF16__)
#include <immintrin.h>
#define SHRINK_IN_BF16 1
/* shrink_rows on AVX512-BF16: the bfloat16 rows of x (xr) and A multiplied as they are stored, 32 pairs per
 * instruction summed into float32 (vdpbf16ps: products exact, sums rounded), the tail as in shrink_rows. Half
 * the instructions of converting both to float32 first, and no converted copy of x. */
static inline __attribute__((always_inline)) void shrink_rows_bf16(const scalar_t *const *xr, const int nr,
                                                                    const scalar_t *a, int64_t na,
                                                                    int64_t in_features, float *h,
                                                                    int64_t h_stride) {
  const int64_t full = in_features / 32 * 32;
  int64_t j = 0;
  for (; j + 2 <= na; j += 2) {
    const scalar_t *a0 = a + j * in_features, *a1 = a0 + in_features;
    __m512 acc0[APPLY_ROWS], acc1[APPLY_ROWS];
    for (int g = 0; g < nr; g++) acc0[g] = acc1[g] = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 32) {
      /* The next pair of A rows, one line per step: the rows of every slot stream in from memory each step. */
      __builtin_prefetch(a1 + in_features + k);
      __builtin_prefetch(a1 + 2 * in_features + k);
      const __m512bh va0 = (__m512bh)_mm512_loadu_si512(a0 + k), va1 = (__m512bh)_mm512_loadu_si512(a1 + k);
      for (int g = 0; g < nr; g++) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[g] + k);
        acc0[g] = _mm512_dpbf16_ps(acc0[g], xv, va0);
        acc1[g] = _mm512_dpbf16_ps(acc1[g], xv, va1);
      }
    }
    for (int g = 0; g < nr; g++) {
      float s0 = _mm512_reduce_add_ps(acc0[g]), s1 = _mm512_reduce_add_ps(acc1[g]);
      for (int64_t k = full; k < in_features; k++) {
        s0 += load1(xr[g] + k) * load1(a0 + k);
        s1 += load1(xr[g] + k) * load1(a1 + k);
      }
      h[g * h_stride + j] = s0;
      h[g * h_stride + j + 1] = s1;
    }
  }
  for (; j < na; j++) {
    const scalar_t *a0 = a + j * in_features;
    __m512 acc0[APPLY_ROWS];
    for (int g = 0; g < nr; g++) acc0[g] = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 32) {
      const __m512bh va0 = (__m512bh)_mm512_loadu_si512(a0 + k);
      for (int g = 0; g < nr; g++)
        acc0[g] = _mm512_dpbf16_ps(acc0[g], (__m512bh)_mm512_loadu_si512(xr[g] + k), va0);
    }
    for (int g = 0; g < nr; g++) {
      float s0 = _mm512_reduce_add_ps(acc0[g]);
      for (int64_t k = full; k < in_features; k++) s0 += load1(xr[g] + k) * load1(a0 + k);
      h[g * h_stride + j] = s0;
    }
  }
}
#else
#define SHRINK_IN_BF16 0
#endif

/* Outputs [first, first + EXPAND_TILE) of nr (<= APPLY_ROWS) rows: every rank's row of the B tile loaded once
 * for all rows, summed from 0 in rank order, then added to y once (the order of expand_rank_major). */
static inline __attribute__((always_inline)) void expand_rows(const float *h, int64_t h_stride, const int nr,
                                                               const scalar_t *bs, int64_t out_features,
                                                               int64_t rank, int64_t first,
                                                               scalar_t *const *yt) {
  v16f acc[APPLY_ROWS][EXPAND_TILE / 16];
  for (int g = 0; g < nr; g++)
    for (int v = 0; v < EXPAND_TILE / 16; v++) acc[g][v] = (v16f){0};
  for (int64_t r = 0; r < rank; r++) {
    const scalar_t *row = bs + r * out_features + first;
    /* PREFETCH_TILES tiles ahead in this rank's row: B's rows are out_features apart, too many streams for the
     * hardware prefetcher to follow from memory (a decode step reads every adapter's B once). */
    if (first + (PREFETCH_TILES + 1) * EXPAND_TILE <= out_features) {
      __builtin_prefetch(row + PREFETCH_TILES * EXPAND_TILE);
      __builtin_prefetch(row + PREFETCH_TILES * EXPAND_TILE + 32);
    }
    v16f vb[EXPAND_TILE / 16];
    for (int v = 0; v < EXPAND_TILE / 16; v++) vb[v] = loadv16(row + 16 * v);
    for (int g = 0; g < nr; g++) {
      const v16f hr = (v16f){0} + h[g * h_stride + r];
      for (int v = 0; v < EXPAND_TILE / 16; v++) acc[g][v] += hr * vb[v];
    }
  }
  for (int g = 0; g < nr; g++)
    for (int v = 0; v < EXPAND_TILE / 16; v++) add_store16(yt[g] + first + 16 * v, acc[g][v]);
}

int pagoda_lora_apply(const scalar_t *x, int64_t x_stride, const scalar_t *a, const int64_t *slots, int64_t rows,
                      int64_t in_features, int64_t rank, int64_t num_shards, const scalar_t *const *b,
                      const int64_t *sizes, const int64_t *offsets, const int64_t *used, int64_t num_slots,
                      scalar_t *y, int64_t y_stride, int64_t num_threads) {
  if (check_slots(slots, rows, num_slots)) return 1;
  if (num_shards < 1 || num_shards > 8 || rank < 1 || rank > 512) return 3;
  const int64_t hw = num_shards * rank; /* h's width: every shard's rank rows */
  int64_t width = 0, tiles = 0, count = 0;
  for (int64_t i = 0; i < num_shards; i++)
    if (used[i]) {
      width += sizes[i];
      tiles += (sizes[i] + EXPAND_TILE - 1) / EXPAND_TILE;
    }
  for (int64_t t = 0; t < rows; t++) count += slots[t] >= 0;
  if (count == 0 || tiles == 0) return 0;
  /* The rows of each slot, in row order: order[start[s] .. start[s + 1]). */
  int64_t *order = malloc((size_t)count * sizeof *order);
  int64_t *start = calloc((size_t)num_slots + 1, sizeof *start);
  float *h = malloc((size_t)count * (size_t)hw * sizeof *h);
  if (order == NULL || start == NULL || h == NULL) {
    free(order);
    free(start);
    free(h);
    return 2;
  }
  for (int64_t t = 0; t < rows; t++)
    if (slots[t] >= 0) start[slots[t] + 1]++;
  for (int64_t s = 0; s < num_slots; s++) start[s + 1] += start[s];
  {
    int64_t *next = malloc((size_t)num_slots * sizeof *next);
    if (next == NULL) {
      free(order);
      free(start);
      free(h);
      return 2;
    }
    memcpy(next, start, (size_t)num_slots * sizeof *next);
    for (int64_t t = 0; t < rows; t++)
      if (slots[t] >= 0) order[next[slots[t]]++] = t;
    free(next);
  }
  /* Work items: phase 1 a block of APPLY_ROWS rows of one slot (every block starts a slot's run or follows a
   * full block), phase 2 (slot, used shard's tile). */
  int64_t blocks = 0;
  for (int64_t s = 0; s < num_slots; s++) blocks += (start[s + 1] - start[s] + APPLY_ROWS - 1) / APPLY_ROWS;
  const int parallel = num_threads > 1 && count * rank * (num_shards * in_features + width) >= APPLY_PARALLEL_MIN_WORK;
  int failed = 0; /* a block's conversion buffer could not be allocated: no expand runs, y is left as it was */
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < blocks; item++) {
      int64_t s = 0, first = 0, seen = 0; /* find the item's slot and first row (slots are few) */
      for (; s < num_slots; s++) {
        const int64_t n = (start[s + 1] - start[s] + APPLY_ROWS - 1) / APPLY_ROWS;
        if (item < seen + n) {
          first = start[s] + (item - seen) * APPLY_ROWS;
          break;
        }
        seen += n;
      }
      const int64_t end = first + APPLY_ROWS < start[s + 1] ? first + APPLY_ROWS : start[s + 1];
      const int nr = (int)(end - first);
      const scalar_t *xr[APPLY_ROWS];
      for (int g = 0; g < nr; g++) xr[g] = x + order[first + g] * x_stride;
      /* x as float32 rows: float32 x itself; bfloat16 on AVX512-BF16 none (read as stored); else the block's
       * rows converted once into a buffer of its own (bounded: a long prompt needs no copy of all of x). */
      const float *xb[APPLY_ROWS];
      float *converted = NULL;
      if (PAGODA_DTYPE == PAGODA_FLOAT32) {
        for (int g = 0; g < nr; g++) xb[g] = (const float *)(const void *)xr[g];
      } else if (!SHRINK_IN_BF16) {
        converted = malloc((size_t)nr * (size_t)in_features * sizeof *converted);
        if (converted == NULL) {
#pragma omp atomic write
          failed = 1;
          continue;
        }
        for (int g = 0; g < nr; g++) {
          for (int64_t k = 0; k < in_features; k++) converted[g * in_features + k] = load1(xr[g] + k);
          xb[g] = converted + g * in_features;
        }
      }
      const scalar_t *as = a + s * hw * in_features;
      for (int64_t i = 0; i < num_shards; i++) {
        if (!used[i]) continue;
        const scalar_t *ai = as + i * rank * in_features;
        float *hb = h + first * hw + i * rank;
#if SHRINK_IN_BF16
        switch (nr) {
          case 1: shrink_rows_bf16(xr, 1, ai, rank, in_features, hb, hw); break;
          case 2: shrink_rows_bf16(xr, 2, ai, rank, in_features, hb, hw); break;
          case 3: shrink_rows_bf16(xr, 3, ai, rank, in_features, hb, hw); break;
          default: shrink_rows_bf16(xr, APPLY_ROWS, ai, rank, in_features, hb, hw); break;
        }
        continue;
#endif
        switch (nr) { /* a constant row count, so that the accumulators live in registers */
          case 1: shrink_rows(xb, 1, ai, rank, in_features, hb, hw); break;
          case 2: shrink_rows(xb, 2, ai, rank, in_features, hb, hw); break;
          case 3: shrink_rows(xb, 3, ai, rank, in_features, hb, hw); break;
          default: shrink_rows(xb, APPLY_ROWS, ai, rank, in_features, hb, hw); break;
        }
      }
      free(converted);
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < num_slots * tiles; item++) {
      const int64_t s = item / tiles;
      if (failed || start[s + 1] == start[s]) continue; /* failed: read after the barrier that ends phase 1 */
      int64_t i = 0, tile = item % tiles;
      for (; i < num_shards; i++) { /* the tile's shard */
        if (!used[i]) continue;
        const int64_t n = (sizes[i] + EXPAND_TILE - 1) / EXPAND_TILE;
        if (tile < n) break;
        tile -= n;
      }
      const int64_t first = tile * EXPAND_TILE;
      const int64_t last = first + EXPAND_TILE < sizes[i] ? first + EXPAND_TILE : sizes[i];
      const scalar_t *bs = b[i] + s * rank * sizes[i];
      for (int64_t g0 = start[s]; g0 < start[s + 1]; g0 += APPLY_ROWS) {
        const int64_t g1 = g0 + APPLY_ROWS < start[s + 1] ? g0 + APPLY_ROWS : start[s + 1];
        const float *hb = h + g0 * hw + i * rank;
        if (last - first < EXPAND_TILE) { /* a partial tile: the scalar-tailed loop */
          for (int64_t g = g0; g < g1; g++)
            expand_rank_major(hb + (g - g0) * hw, bs, sizes[i], rank, first, last,
                              y + order[g] * y_stride + offsets[i]);
          continue;
        }
        scalar_t *yt[APPLY_ROWS];
        for (int64_t g = g0; g < g1; g++) yt[g - g0] = y + order[g] * y_stride + offsets[i];
        switch (g1 - g0) {
          case 1: expand_rows(hb, hw, 1, bs, sizes[i], rank, first, yt); break;
          case 2: expand_rows(hb, hw, 2, bs, sizes[i], rank, first, yt); break;
          case 3: expand_rows(hb, hw, 3, bs, sizes[i], rank, first, yt); break;
          default: expand_rows(hb, hw, APPLY_ROWS, bs, sizes[i], rank, first, yt); break;
        }
      }
    }
  }
  free(order);
  free(start);
  free(h);
  return failed ? 2 : 0;
}
