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
 * Rows are split over threads when large enough; each row is computed whole by one thread. */
/* pagoda_lora_apply on one thread, rows grouped by slot: each row of A and each tile of B is read once per slot
 * (from L1 across that slot's rows) instead of once per row. Every output is summed in the same order as the
 * row-at-a-time loop, so both give the same bits. Status 2: out of memory (the caller falls back). */
static int apply_grouped(const scalar_t *x, int64_t x_stride, const scalar_t *a, const int64_t *slots, int64_t rows,
                         int64_t in_features, int64_t rank, int64_t num_shards, const scalar_t *const *b,
                         const int64_t *sizes, const int64_t *offsets, const int64_t *used, int64_t num_slots,
                         scalar_t *y, int64_t y_stride) {
  int64_t *order = malloc((size_t)(rows > 0 ? rows : 1) * sizeof *order);
  float *h = malloc((size_t)(rows > 0 ? rows : 1) * (size_t)rank * sizeof *h);
  if (order == NULL || h == NULL) {
    free(order);
    free(h);
    return 2;
  }
  int64_t count = 0;
  for (int64_t s = 0; s < num_slots; s++)
    for (int64_t t = 0; t < rows; t++)
      if (slots[t] == s) order[count++] = t;
  for (int64_t g0 = 0; g0 < count;) {
    const int64_t s = slots[order[g0]];
    int64_t g1 = g0;
    while (g1 < count && slots[order[g1]] == s) g1++;
    const scalar_t *as = a + s * num_shards * rank * in_features;
    for (int64_t i = 0; i < num_shards; i++) {
      if (!used[i]) continue;
      for (int64_t r = 0; r < rank; r++) {
        const scalar_t *ar = as + (i * rank + r) * in_features;
        for (int64_t g = g0; g < g1; g++) h[g * rank + r] = dot(x + order[g] * x_stride, ar, in_features);
      }
      const scalar_t *bs = b[i] + s * rank * sizes[i];
      for (int64_t first = 0; first < sizes[i]; first += EXPAND_TILE) {
        const int64_t last = first + EXPAND_TILE < sizes[i] ? first + EXPAND_TILE : sizes[i];
        for (int64_t g = g0; g < g1; g++)
          expand_rank_major(h + g * rank, bs, sizes[i], rank, first, last, y + order[g] * y_stride + offsets[i]);
      }
    }
    g0 = g1;
  }
  free(order);
  free(h);
  return 0;
}

int pagoda_lora_apply(const scalar_t *x, int64_t x_stride, const scalar_t *a, const int64_t *slots, int64_t rows,
                      int64_t in_features, int64_t rank, int64_t num_shards, const scalar_t *const *b,
                      const int64_t *sizes, const int64_t *offsets, const int64_t *used, int64_t num_slots,
                      scalar_t *y, int64_t y_stride, int64_t num_threads) {
  if (check_slots(slots, rows, num_slots)) return 1;
  if (num_shards < 1 || num_shards > 8 || rank < 1 || rank > 512) return 3;
  int64_t width = 0;
  for (int64_t i = 0; i < num_shards; i++) width += used[i] ? sizes[i] : 0;
  const int parallel = rows * rank * (num_shards * in_features + width) >= PARALLEL_MIN_WORK;
  if (!parallel) {
    const int status = apply_grouped(x, x_stride, a, slots, rows, in_features, rank, num_shards, b, sizes,
                                     offsets, used, num_slots, y, y_stride);
    if (status != 2) return status;  /* 2: no memory for its buffers; the row-at-a-time loop needs none */
  }
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
  for (int64_t t = 0; t < rows; t++) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    float h[8 * 512];
    const scalar_t *xt = x + t * x_stride;
    const scalar_t *as = a + s * num_shards * rank * in_features;
    scalar_t *yt = y + t * y_stride;
    for (int64_t i = 0; i < num_shards; i++) {
      if (!used[i]) continue;
      float *hi = h + i * rank;
      for (int64_t r = 0; r < rank; r++) hi[r] = dot(xt, as + (i * rank + r) * in_features, in_features);
      const scalar_t *bs = b[i] + s * rank * sizes[i];
      for (int64_t first = 0; first < sizes[i]; first += EXPAND_TILE) {
        const int64_t last = first + EXPAND_TILE < sizes[i] ? first + EXPAND_TILE : sizes[i];
        expand_rank_major(hi, bs, sizes[i], rank, first, last, yt + offsets[i]);
      }
    }
  }
  return 0;
}
