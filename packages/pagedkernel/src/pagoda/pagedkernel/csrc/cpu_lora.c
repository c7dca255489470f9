/* Batched multi-LoRA on the CPU: every row of a flat batch gathers its own adapter's A and B by a slot index.
 *
 * The specification is pagoda/pagedkernel/lora/torch_lora.py:
 *   shrink: h[t, r] = scales[s] * sum_k x[t, k] * a[s, r, k]           (s = slots[t]; h is float32)
 *   expand: y[t, offset + n] = y[t, offset + n] + sum_r h[t, r] * b[s, n, r]   (summed in float32, rounded once)
 * A row whose slot is negative has no adapter: shrink writes its h row as 0 and does no product, expand does not
 * touch it. Every slot is checked against num_slots before anything is written (status 1: out of range).
 * x, a, b and y share the storage dtype of -DPAGODA_DTYPE (cpu_dtype.h); every product is accumulated in float32,
 * eight lanes at a time. Work items (rows for shrink, row x column tiles for expand) are split over torch's
 * OpenMP pool when built with -fopenmp and the call is large enough (PARALLEL_MIN_WORK); each output is computed whole by one thread, so the result does not
 * depend on the thread count.
 */
#include <stdint.h>

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

/* sum_i p[i] * q[i] in float32, eight lanes then the tail (the same order for every row). */
static inline float dot(const scalar_t *p, const scalar_t *q, int64_t n) {
  v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc += loadv8(p + i) * loadv8(q + i);
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; i++) sum += load1(p + i) * load1(q + i);
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

int pagoda_lora_expand(const float *h, const scalar_t *b, const int64_t *slots, int64_t rows, int64_t out_features,
                       int64_t rank, int64_t num_slots, scalar_t *y, int64_t y_stride, int64_t offset,
                       int64_t num_threads) {
  if (check_slots(slots, rows, num_slots)) return 1;
  const int64_t tiles = (out_features + EXPAND_TILE - 1) / EXPAND_TILE;
  const int parallel = rows * out_features * rank >= PARALLEL_MIN_WORK;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
  for (int64_t item = 0; item < rows * tiles; item++) {
    const int64_t t = item / tiles;
    const int64_t s = slots[t];
    if (s < 0) continue;
    const int64_t first = (item % tiles) * EXPAND_TILE;
    const int64_t last = first + EXPAND_TILE < out_features ? first + EXPAND_TILE : out_features;
    const float *ht = h + t * rank;
    const scalar_t *bs = b + s * out_features * rank;
    scalar_t *yt = y + t * y_stride + offset;
    for (int64_t n = first; n < last; n++) {
      const scalar_t *bn = bs + n * rank;
      float sum = 0.0f;
      for (int64_t r = 0; r < rank; r++) sum += ht[r] * load1(bn + r);
      yt[n] = store1(load1(yt + n) + sum);
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
