/* The LM head and the draw of a few rows in one pass: logits = x @ W^T for a GGUF-quantized W [vocab, k], computed
 * a chunk of vocabulary rows at a time into a buffer that stays in L1, and each chunk reduced at once, so the
 * [rows, vocab] logits are never written out nor read back.
 *
 * The specification is the unfused pair: cpu_quant.c's GEMV (pagoda_quant_matmul, whose per-column code this file
 * includes and calls on each chunk: every logit is bitwise the GEMV's, bfloat16 rounding included) followed by the
 * sampling op (sampling/torch_sampling.py) on rows without min_p:
 *   - greedy rows (inv_t 0): the argmax of the logits, the lowest index on ties;
 *   - sampled rows: the argmax of x - log(-log u) over the tokens with x > -inf, x = logit * inv_t in float32 and
 *     u the row key's uniform of each vocabulary index (cpu_gumbel.h: the same bits as rng.py / fmath.py), the
 *     lowest index on ties. An element whose x is more than GUMBEL_SPAN (plus a rounding slack) below the best
 *     score so far cannot win (-log(-log u) <= 24 ln 2), so it is skipped unhashed: the race is exact.
 *   - top_k / top_p rows: per-chunk candidates, then the exact kept set where they prove it (cpu_head_nucleus.h),
 *     else status HEAD_FALLBACK: the caller samples that row from its logits.
 * Status per row as the op's: NONFINITE when some x is NaN or +inf, NO_TOKEN when every x is -inf (token 0).
 *
 * Threads: chunks are handed out guided on torch's OpenMP pool (as the GEMV's columns); each thread keeps its own
 * best per row and the bests are merged at the end by (value, lowest index), an order-free rule, so the tokens do
 * not depend on the thread count.
 */
#include "cpu_quant.c"
#include "cpu_gumbel.h"

#define HEAD_CHUNK 128 /* vocabulary rows per chunk: rows x 128 logits (at most 8 KB) stay in L1 */
#define HEAD_MAX_ROWS MAX_ROWS /* one pass of the GEMV's columns */
#define MAX_THREADS_HEAD 256  /* threads whose candidates one row merges */

enum { HEAD_OK = 0, HEAD_NONFINITE = 1, HEAD_NO_TOKEN = 2 };

/* One row's reduction so far: the best value (the logit for a greedy row, the Gumbel score for a sampled one) and
 * its index, whether a NaN / +inf was seen and whether any x > -inf was. */
typedef struct {
  float best;
  int64_t best_i;
  int bad, any;
} head_best_t;

/* Whether (value, index) beats the current best: greater, or equal at a lower index. */
static inline int head_beats(float v, int64_t i, const head_best_t *b) {
  return b->best_i < 0 || v > b->best || (v == b->best && i < b->best_i);
}

/* Vectors of HEAD_LANES floats for the reduction's screening: one register of the build's width. Why not sixteen
 * everywhere: on AVX2, GCC lowered the 512-bit vectors' compares and lane reads through memory, and the reduction
 * then cost a 16-row draw of Gemma 3's 262k-row head a quarter more than the GEMV alone (eight lanes: ~3%). */
#if PATH == 2
#define HEAD_LANES 16
#else
#define HEAD_LANES 8
#endif
typedef float hvf __attribute__((vector_size(4 * HEAD_LANES)));
typedef int32_t hvi __attribute__((vector_size(4 * HEAD_LANES)));

static inline int hv_any(hvi m) {
#if PATH == 2
  return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#elif PATH == 1
  return !_mm256_testz_si256((__m256i)m, (__m256i)m);
#else
  int32_t acc = 0;
  for (int l = 0; l < HEAD_LANES; l++) acc |= m[l];
  return acc != 0;
#endif
}

typedef uint64_t hvq __attribute__((vector_size(4 * HEAD_LANES))); /* HEAD_LANES / 2 hashes */
typedef uint32_t hvu __attribute__((vector_size(4 * HEAD_LANES)));

/* The words of the HEAD_LANES vocabulary indices from `base` (even): one SplitMix64 output per pair of indices,
 * its low half for the even index and its high half for the odd one (word_at), HEAD_LANES / 2 hashes at once. */
static inline hvu head_words(uint64_t key, int64_t base) {
  hvq c;
  for (int p = 0; p < HEAD_LANES / 2; p++) c[p] = (uint64_t)(base >> 1) + (uint64_t)p + 1;
  hvq z = key + c * GOLDEN;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  hvu words;
  memcpy(&words, &z, sizeof words); /* little-endian: lane 2p is the low half of hash p, lane 2p + 1 its high half */
  return words;
}

/* Reduce logits y[0..HEAD_CHUNK) (column j0 + i is vocabulary index j0 + i, j0 even; lanes past `len` hold -inf) of
 * one row into its best. HEAD_LANES lanes at a time: NaN / +inf / finite flags; for a greedy row the lanes at least
 * its best value, looked at one by one; for a sampled row the lanes within GUMBEL_SPAN (plus the rounding slack of
 * race_set in cpu_sampling.c) of the best score are hashed together, and the word's bound (-log u >= 1 - u = w / 2^24
 * with w = 2^24 - 2k - 1 >= 2^floor(log2 w), so the score is at most x + (24 - floor(log2 w)) ln 2: race_chunk's)
 * leaves the two logs to a handful. */
static void head_reduce(const float *y, int64_t len, int64_t j0, float inv_t, uint64_t key, head_best_t *b) {
  const float factor = inv_t == 0.0f ? 1.0f : inv_t; /* x = logits * factor, as torch_sampling.scale */
  hvi bad = (hvi){0}, any = (hvi){0};
  for (int64_t v = 0; v < HEAD_CHUNK; v += HEAD_LANES) {
    hvf x;
    memcpy(&x, y + v, sizeof x);
    x = x * factor;
    bad |= (x != x) | (x == INFINITY);
    const hvi finite = x > -INFINITY;
    any |= finite;
    if (inv_t == 0.0f) {
      /* a greedy row's first lanes are all looked at (even -inf ones), then those >= its best (ties may win) */
      if (b->best_i >= 0 && !hv_any(x >= b->best)) continue;
      for (int l = 0; l < HEAD_LANES && v + l < len; l++) {
        const int64_t j = j0 + v + l;
        /* chunks arrive in any order: strictly greater, or equal at a lower index than the best from elsewhere */
        if (b->best_i < 0 || x[l] > b->best || (x[l] == b->best && j < b->best_i)) b->best = x[l], b->best_i = j;
      }
      continue;
    }
    const float slack = b->best_i >= 0 ? 1e-3f + fabsf(b->best) * 1e-5f : 0.0f;
    const float lo = b->best_i >= 0 ? b->best - GUMBEL_SPAN - slack : -INFINITY;
    if (!hv_any((x >= lo) & finite)) continue; /* -inf (and NaN: the row fails anyway) is never drawn */
    const hvu words = head_words(key, j0 + v);
    const hvi w = (int32_t)(1 << 24) - 2 * (hvi)(words >> 9) - 1;
    const hvi lg = ((hvi)__builtin_convertvector(w, hvf) >> 23) - 127;
    hvi go = (x + __builtin_convertvector(24 - lg, hvf) * 0.6932f >= b->best - slack) & finite;
    if (b->best_i < 0) go = finite; /* nothing to beat yet */
    if (!hv_any(go)) continue;
    for (int l = 0; l < HEAD_LANES; l++) {
      if (!go[l]) continue;
      const int64_t j = j0 + v + l;
      const float s = gumbel_score(x[l], words[l]);
      if (b->best_i < 0 || s > b->best || (s == b->best && j < b->best_i)) b->best = s, b->best_i = j;
    }
  }
  b->bad |= hv_any(bad);
  b->any |= hv_any(any);
}

#include "cpu_head_nucleus.h"

/* Columns j0..j1 of the logits of every row into buf ([rows, HEAD_CHUNK], float32 or bfloat16 bits): exactly the
 * code pagoda_quant_matmul runs for those columns (its one-row register path where it takes it). */
static void head_columns(int64_t type, columns_fn columns, const uint8_t *weight, int64_t row_bytes, int64_t j0,
                         int64_t j1, int64_t k, const int8_t *xq, const float *xd, const int32_t *xs,
                         const void *xb_any, const xquad *xg, int64_t rows, void *buf, int y_bf16) {
  const uint8_t *w = weight + j0 * row_bytes;
#if PATH >= 1
  if (rows == 1 && ONE_ROW_TYPE(type)) {
    void *y = buf;
    const int64_t len = j1 - j0;
#if PATH == 2
    const xblock *xb = (const xblock *)xb_any;
#define ONE_ROW(T) one_row_columns(T, w, 0, len, k, xb, xd, xs, y, y_bf16)
#else
    (void)xb_any;
#define ONE_ROW(T) one_row_columns(T, w, 0, len, k, xq, xd, xs, y, y_bf16)
#endif
    ONE_ROW_DISPATCH(type);
#undef ONE_ROW
    return;
  }
#endif
  (void)xb_any;
  columns(w, 0, j1 - j0, k, xq, xd, xs, xg, rows, buf, HEAD_CHUNK, y_bf16);
}

/* tokens[r] and status[r] of each row r < rows: W [n, k] of `type`, x [rows, k] (rows x_stride elements apart,
 * float32 or bfloat16), logits rounded to bfloat16 when y_bf16 (as the unfused GEMV writes them for a bfloat16
 * model), inv_t[r] 0 for a greedy row, top_k[r] 0 and top_p[r] 1 when disabled (cpu_head_nucleus.h), keys[r] the
 * row's RNG key. A status of HEAD_FALLBACK asks the caller to sample that row from its logits: where `logits` is
 * not NULL ([rows, n], bfloat16 bits when y_bf16, else float32), the logits of every top_k / top_p row are written
 * there as they are computed (a flat row's candidates prove nothing, and the logits cost a write, where computing
 * them again costs the whole GEMV). 0 on success, 1 for an unknown type, k not a multiple of the block, more than
 * HEAD_MAX_ROWS rows or a top_k above HEAD_MAX_TOP_K, 2 when the work space cannot be allocated. */
int pagoda_fused_head(int64_t type, const uint8_t *weight, int64_t n, int64_t k, const void *x, int64_t x_stride,
                      int64_t x_bf16, int64_t rows, int64_t y_bf16, const float *inv_t, const int64_t *top_k,
                      const float *top_p, const int64_t *keys, int64_t *tokens, int32_t *status, void *logits,
                      int64_t num_threads) {
  int elems, bytes, has_offset;
  type_info(type, &elems, &bytes, &has_offset);
  columns_fn columns = columns_for(type);
  if (columns == NULL || k % elems != 0 || rows > HEAD_MAX_ROWS || rows < 0) return 1;
  if (rows == 0) return 0;
  int64_t kk[HEAD_MAX_ROWS], cap[HEAD_MAX_ROWS], max_cap = 0; /* top_k in force; candidates (0: not truncated) */
  for (int64_t r = 0; r < rows; r++) {
    kk[r] = top_k[r] > 0 && top_k[r] < n ? top_k[r] : 0;
    cap[r] = inv_t[r] != 0.0f && (kk[r] || top_p[r] < 1.0f) ? (kk[r] ? kk[r] + 64 : HEAD_NUCLEUS) : 0;
    if (kk[r] > HEAD_MAX_TOP_K) return 1;
    max_cap = cap[r] > max_cap ? cap[r] : max_cap;
  }
  if (num_threads < 1 || n * k < (1 << 16)) num_threads = 1; /* waking threads would cost more */
  if (num_threads > MAX_THREADS_HEAD) num_threads = MAX_THREADS_HEAD;
  const int64_t xblocks = k / QK, row_bytes = k / elems * bytes;
  int8_t *xq = malloc((size_t)(rows * k));
  float *xd = malloc(sizeof(float) * (size_t)(rows * xblocks));
  int32_t *xs = malloc(sizeof(int32_t) * (size_t)(rows * xblocks));
  nucleus_t *nu = calloc((size_t)(num_threads * rows), sizeof(nucleus_t));
  cand_t *pool = max_cap ? malloc(sizeof(cand_t) * (size_t)(num_threads * rows * 2 * max_cap)) : NULL;
  cand_t *all = max_cap ? malloc(sizeof(cand_t) * (size_t)(num_threads * 2 * max_cap)) : NULL;
  void *xb = NULL;
#if PATH == 2
  xb = aligned_alloc(32, sizeof(xblock) * (size_t)xblocks);
#endif
  const int64_t groups = QUAD_TYPE(type) ? quad_groups(k) : 0; /* x's quad form only for a quad-order weight */
  xquad *xg = groups ? aligned_alloc(64, sizeof(xquad) * (size_t)(rows * groups)) : NULL;
  if (!xq || !xd || !xs || !nu || (max_cap && (!pool || !all)) || (PATH == 2 && !xb) || (groups && !xg)) {
    free(xq), free(xd), free(xs), free(nu), free(pool), free(all), free(xb), free(xg);
    return 2;
  }
  for (int64_t t = 0; t < num_threads; t++)
    for (int64_t r = 0; r < rows; r++) {
      const int open = top_p[r] < 1.0f && !kk[r]; /* W holds mass outside the list */
      const double hopeless = open ? HEAD_GIVE_UP * (double)cap[r] * (1.0 - top_p[r]) / top_p[r] : INFINITY;
      nu[t * rows + r] = (nucleus_t){pool + (t * rows + r) * 2 * max_cap, 0, cap[r], -INFINITY, 0, -INFINITY,
                                     0.0, 0, top_p[r] < 1.0f, hopeless, 0};
    }
  quantize_rows(x, x_stride, (int)x_bf16, rows, k, xq, xd, xs, xg);
  if (R16_SIGNED_X(type)) r16_signed_x(xq, xq, rows * k);
#if PATH == 2
  prepare_x(xq, xblocks, (xblock *)xb);
#endif
  head_best_t best[HEAD_MAX_ROWS];
  for (int64_t r = 0; r < rows; r++) best[r] = (head_best_t){-INFINITY, -1, 0, 0};
  const int64_t chunks = (n + HEAD_CHUNK - 1) / HEAD_CHUNK;
#pragma omp parallel num_threads(num_threads)
  {
#ifdef _OPENMP
    nucleus_t *my_nu = nu + omp_get_thread_num() * rows;
#else
    nucleus_t *my_nu = nu;
#endif
    head_best_t mine[HEAD_MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) mine[r] = (head_best_t){-INFINITY, -1, 0, 0};
    float y[HEAD_MAX_ROWS * HEAD_CHUNK];
    uint16_t y16[HEAD_MAX_ROWS * HEAD_CHUNK];
#pragma omp for schedule(guided) nowait
    for (int64_t c = 0; c < chunks; c++) {
      const int64_t j0 = c * HEAD_CHUNK, j1 = j0 + HEAD_CHUNK < n ? j0 + HEAD_CHUNK : n, len = j1 - j0;
      head_columns(type, columns, weight, row_bytes, j0, j1, k, xq, xd, xs, xb, xg, rows, y_bf16 ? (void *)y16 : y,
                   (int)y_bf16);
      for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * HEAD_CHUNK;
        if (logits && cap[r]) {
          if (y_bf16) memcpy((uint16_t *)logits + r * n + j0, y16 + r * HEAD_CHUNK, sizeof(uint16_t) * (size_t)len);
          else memcpy((float *)logits + r * n + j0, yr, sizeof(float) * (size_t)len);
        }
        if (y_bf16)
          for (int64_t i = 0; i < len; i++) yr[i] = as_float((uint32_t)y16[r * HEAD_CHUNK + i] << 16);
        for (int64_t i = len; i < HEAD_CHUNK; i++) yr[i] = -INFINITY; /* the last chunk's tail: never drawn */
        if (cap[r])
          nucleus_chunk(&my_nu[r], yr, j0, inv_t[r], &mine[r].bad, &mine[r].any);
        else
          head_reduce(yr, len, j0, inv_t[r], (uint64_t)keys[r], &mine[r]);
      }
    }
#pragma omp critical
    for (int64_t r = 0; r < rows; r++) {
      const head_best_t *m = &mine[r];
      if (m->best_i >= 0 && head_beats(m->best, m->best_i, &best[r])) best[r].best = m->best, best[r].best_i = m->best_i;
      best[r].bad |= m->bad;
      best[r].any |= m->any;
    }
  }
  for (int64_t r = 0; r < rows; r++) {
    int st = best[r].bad ? HEAD_NONFINITE : best[r].any ? HEAD_OK : HEAD_NO_TOKEN;
    int64_t token = best[r].best_i;
    if (st == HEAD_OK && cap[r]) {
      nucleus_t per_thread[MAX_THREADS_HEAD];
      for (int64_t t = 0; t < num_threads; t++) per_thread[t] = nu[t * rows + r];
      token = nucleus_draw(per_thread, num_threads, kk[r], top_p[r], (uint64_t)keys[r], all);
      if (token < 0) st = HEAD_FALLBACK;
    }
    status[r] = st;
    tokens[r] = st == HEAD_OK ? token : 0;
  }
  free(xq), free(xd), free(xs), free(nu), free(pool), free(all), free(xb), free(xg);
  return 0;
}
