/* A decode step's decoder layers (Llama family, Gemma 3) in one native call: for up to 64 rows (one query token
 * per sequence, or a few per sequence: a speculative step's token and its drafts, a short prompt chunk), every layer's RMSNorm, QKV GEMV, (q/k norms and) rotary, KV write, paged attention, output
 * projection, (norm,) add + norm, gate/up GEMV, SiLU or GELU, down GEMV, (norm and) residual add, on one thread
 * team for the whole call.
 *
 * The specification is the server's torch layers (pagoda.server.models.llama.LlamaDecoderLayer and
 * gemma3.Gemma3DecoderLayer) as they run on the CPU: this file includes the kernels that layer calls (cpu_fused.c's norm, rotary and activation, cpu_attention.c's
 * attention item, cpu_quant.c's GEMV columns and vector panels) and chains them with the same roundings, so its output is bitwise
 * that layer's (tested). What it removes is everything between the kernels: ~10 Python module calls, ~15 ctypes
 * entries and ~10 OpenMP parallel regions per layer, each microseconds at one row.
 *
 * Threads: one OpenMP parallel region per call (torch's pool, as the other kernels use); between the phases that
 * depend on each other a barrier, not a new region: per layer 5 barriers (after QKV, attention, O, gate/up + act,
 * down). Columns of each GEMV are claimed from a shared counter in shrinking runs (`claim`: long contiguous runs
 * first, as the GEMV's guided schedule, so a thread the OS deschedules holds up only a small run). Every output
 * element is still computed whole by one thread, so the result does not depend on the thread count. The cheap
 * row-wise steps (norms, int8 quantization of x, residual adds) run redundantly on every thread into its own
 * buffers: cheaper than a barrier. A thread that is done with a phase first asks for (prefetches) a share of the
 * weights the layer reads next (the output projection during attention, the next layer's QKV during the down
 * projection), so their first bytes come from cache when the phase starts.
 *
 * Layers are described by a flat int64 table ([num_layers, LAYER_FIELDS], pointers as integers, see the F_*
 * offsets); Python (pagoda.pagedkernel.decode) builds it once per model.
 */
#include "cpu_fused.c"

/* The attention kernel's options (its own fp-contract pragma: every fusion written out) stay inside this push /
 * pop, so that its scores round as they do in its library. */
#pragma GCC push_options
#include "cpu_attention.c"
#pragma GCC pop_options
#undef MAX_ROWS

#include "cpu_quant.c"

/* Rows of one call. Up to MAX_ROWS (cpu_quant.c's: one pass of the GEMV columns) every part takes int8 x, as
 * qmatmul sends those rows to the GEMV; past it a row-major part goes as qmatmul's `vector` path (vector_panel,
 * the one it runs: bfloat16 pairs for bfloat16 x where the build has them, else float32) and a repacked one stays
 * on its int8 tiles. */
#define DECODE_MAX_ROWS 64
#ifdef FMA_DP
#define VECTOR_DP (PAGODA_DTYPE == PAGODA_BFLOAT16)
#else
#define VECTOR_DP 0
#endif
#define MAX_PARTS 3        /* runs of rows of one weight (q, k, v of three GGUF types) */
#define WEIGHT_FIELDS (1 + 3 * MAX_PARTS)
/* A layer's fields. Norm weights (0: none): INPUT before attention; ATTN_OUT of the attention output before the
 * residual add (Gemma's post-attention norm); MLP of the residual before the MLP; MLP_OUT of the MLP output before
 * its residual add (Gemma's post-feedforward norm); Q / K per head before rotary. ROPE: which cos / sin table;
 * GROUP: which KV cache group's slots and block tables. */
enum { F_INPUT_NORM, F_ATTN_OUT_NORM, F_MLP_NORM, F_MLP_OUT_NORM, F_Q_NORM, F_K_NORM, F_K_CACHE, F_V_CACHE, F_WINDOW,
       F_ROPE, F_GROUP, F_QKV, F_O = F_QKV + WEIGHT_FIELDS, F_GATE_UP = F_O + WEIGHT_FIELDS,
       F_DOWN = F_GATE_UP + WEIGHT_FIELDS, LAYER_FIELDS = F_DOWN + WEIGHT_FIELDS };
enum { PHASES = 6 }; /* claim counters per layer: QKV, attention, O, gate/up, down, rotary + K/V writes */
#define ACT_CHUNK 128 /* gate/up columns per claim at most (both halves' values stay on the stack) */

int64_t pagoda_decode_layer_fields(void) { return LAYER_FIELDS; }
int64_t pagoda_decode_max_parts(void) { return MAX_PARTS; }

/* One weight of a layer: `parts` runs of rows (output columns), each of one GGUF type. */
typedef struct {
  int64_t parts, type[MAX_PARTS], rows[MAX_PARTS];
  const uint8_t *data[MAX_PARTS];
} qweight_t;

static qweight_t weight_at(const int64_t *f) {
  qweight_t w;
  w.parts = f[0];
  for (int64_t i = 0; i < MAX_PARTS; i++) {
    w.type[i] = f[1 + 3 * i];
    w.rows[i] = f[2 + 3 * i];
    w.data[i] = (const uint8_t *)(intptr_t)f[3 + 3 * i];
  }
  return w;
}

/* Rows of x quantized for the GEMV (cpu_quant.c's quantize_row), one thread's copy. */
typedef struct {
  int8_t *q;
  float *d;
  int32_t *s;
  xquad *g; /* every row's quad form (cpu_quad.h), rows quad_groups(k) apart */
  int8_t *r; /* the rows' signed q for repacked parts (cpu_rows16.h): q itself where q is signed already */
  uint32_t *xp;   /* past MAX_ROWS rows: x laid out for row-major parts' vector_panel (every row block) */
  uint32_t *panel; /* and that thread's dequantized panel and tile sums */
  float *acc;
#if PATH == 2
  xblock *xb; /* the one-row VNNI path's form of row 0 */
#endif
} qx_t;

/* Whether a part of this type multiplies `rows` rows on the vector unit (see DECODE_MAX_ROWS). */
static inline int vector_part(int64_t type, int64_t rows) { return rows > MAX_ROWS && !R16_TYPE(type); }

/* x's rows quantized for weight w, with only the forms w's formats read: int8 rows for an int8 part, with the quad
 * form for a quad-order part, the signed copy for a repacked one, the one-row VNNI form for a one-row register
 * part; the vector unit's layout for a row-major part past MAX_ROWS rows. */
static void quantize_x(const scalar_t *x, int64_t x_stride, int64_t rows, int64_t k, const qweight_t *w,
                       qx_t *qx) {
  int int8 = 0, quad = 0, repacked = 0, vector = 0;
  for (int64_t p = 0; p < w->parts; p++) {
    const int64_t type = w->type[p];
    if (vector_part(type, rows)) {
      vector = 1;
      continue;
    }
    int8 = 1, quad |= QUAD_TYPE(type), repacked |= R16_SIGNED_X(type);
  }
  const int x_bf16 = PAGODA_DTYPE == PAGODA_BFLOAT16;
  if (int8) quantize_rows(x, x_stride, x_bf16, rows, k, qx->q, qx->d, qx->s, quad ? qx->g : NULL);
  if (repacked) r16_signed_x(qx->q, qx->r, rows * k);
  const int64_t slots = VECTOR_DP ? k / 2 : k;
  if (vector)
    for (int64_t mb = 0; mb * FMA_MT < rows; mb++)
      vector_pack(x, x_stride, x_bf16, rows, mb, k, VECTOR_DP, qx->xp + mb * slots * FMA_MT);
#if PATH == 2
  int one_row = 0;
  for (int64_t p = 0; p < w->parts; p++) one_row |= ONE_ROW_TYPE(w->type[p]);
  if (rows == 1 && one_row) prepare_x(qx->q, k / QK, qx->xb);
#endif
}

/* Columns j0..j1 of one run of rows (a GGUF type) into y (rows y_stride apart), as pagoda_quant_matmul computes
 * them: the one-row register path for its formats at one row, matmul_columns otherwise. */
static void part_columns(int64_t type, const uint8_t *w, int64_t j0, int64_t j1, int64_t k, const qx_t *qx,
                         int64_t rows, scalar_t *y, int64_t y_stride) {
  const int y_bf16 = PAGODA_DTYPE == PAGODA_BFLOAT16;
  if (vector_part(type, rows)) { /* panels of FMA_PANEL columns, every row block at once */
    int elems, bytes, has_offset;
    type_info(type, &elems, &bytes, &has_offset);
    for (int64_t a = j0; a < j1; a += FMA_PANEL)
      vector_panel(dequantize_for(type), elems, w, k / elems * bytes, k, VECTOR_DP, a,
                   j1 - a < FMA_PANEL ? j1 - a : FMA_PANEL, qx->xp, 0, (rows + FMA_MT - 1) / FMA_MT, rows,
                   qx->panel, qx->acc, y, y_stride, y_bf16);
    return;
  }
#if PATH >= 1
  if (rows == 1 && ONE_ROW_TYPE(type)) {
#if PATH == 2
#define ONE_ROW(T) one_row_columns(T, w, j0, j1, k, qx->xb, qx->d, qx->s, y, y_bf16)
#else
#define ONE_ROW(T) one_row_columns(T, w, j0, j1, k, qx->q, qx->d, qx->s, y, y_bf16)
#endif
    ONE_ROW_DISPATCH(type);
#undef ONE_ROW
    return;
  }
#endif
  columns_for(type)(w, j0, j1, k, R16_SIGNED_X(type) ? qx->r : qx->q, qx->d, qx->s, qx->g, rows, y, y_stride, y_bf16);
}

/* Columns j0..j1 of x W^T for a weight of several runs: each run's share, at its own column offset. */
static void weight_columns(const qweight_t *w, int64_t j0, int64_t j1, int64_t k, const qx_t *qx, int64_t rows,
                           scalar_t *y, int64_t y_stride) {
  int64_t start = 0;
  for (int64_t p = 0; p < w->parts && start < j1; p++) {
    const int64_t stop = start + w->rows[p];
    const int64_t a = j0 > start ? j0 : start, b = j1 < stop ? j1 : stop;
    if (a < b) part_columns(w->type[p], w->data[p], a - start, b - start, k, qx, rows, y + start, y_stride);
    start = stop;
  }
}

/* The first bytes of a thread's share (1 / nthreads) of a weight's blocks, asked for ahead of its use. */
static void prefetch_share(const qweight_t *w, int64_t k, int64_t thread, int64_t nthreads, int64_t limit) {
  for (int64_t p = 0; p < w->parts; p++) {
    int elems, bytes, has_offset;
    type_info(w->type[p], &elems, &bytes, &has_offset);
    const int64_t total = w->rows[p] * (k / elems) * bytes;
    int64_t lo = total * thread / nthreads, hi = total * (thread + 1) / nthreads;
    if (hi - lo > limit) hi = lo + limit;
    for (int64_t at = lo; at < hi; at += 64) __builtin_prefetch(w->data[p] + at, 0, 2);
  }
}

/* A run of columns from a shared counter: about a (2 * nthreads)th of what is left, at least `least`, at most
 * `most`; 0 when none is left. Long runs first (what the prefetchers stream best), short ones at the end. */
static int64_t claim(int64_t *counter, int64_t n, int64_t nthreads, int64_t least, int64_t most, int64_t *j0) {
  int64_t at = __atomic_load_n(counter, __ATOMIC_RELAXED);
  for (;;) {
    if (at >= n) return 0;
    int64_t size = (n - at) / (2 * nthreads);
    size = size < least ? least : size > most ? most : size;
    size -= size % least; /* runs start on multiples of `least`: a repacked part's tiles of 16 stay whole */
    if (size > n - at) size = n - at;
    if (__atomic_compare_exchange_n(counter, &at, at + size, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
      *j0 = at;
      return size;
    }
  }
}

static inline void team_barrier(void) {
#ifdef _OPENMP
#pragma omp barrier
#endif
}

/* y = round(a + b), row by row (torch's add in the storage dtype, and add_norm's sum). */
static void add_rows(const scalar_t *a, const scalar_t *b, scalar_t *y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) storev16(y + i, loadv16(a + i) + loadv16(b + i));
  for (; i < n; i++) y[i] = store1(load1(a + i) + load1(b + i));
}

/* out[j] = round(round(act(gate[j])) * up[j]) for n values, as pagoda_act_and_mul computes each lane (kind 0:
 * GELU, tanh form; 1: SiLU). */
static void act_mul(const scalar_t *gate, const scalar_t *up, scalar_t *out, int64_t n, int kind) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) storev16(out + i, roundv16(actv16(loadv16(gate + i), kind)) * loadv16(up + i));
  if (i < n) {
    scalar_t g[16] = {0}, u[16] = {0}, o[16];
    memcpy(g, gate + i, (size_t)(n - i) * sizeof(scalar_t));
    memcpy(u, up + i, (size_t)(n - i) * sizeof(scalar_t));
    storev16(o, roundv16(actv16(loadv16(g), kind)) * loadv16(u));
    memcpy(out + i, o, (size_t)(n - i) * sizeof(scalar_t));
  }
}

/* Token r's query heads of KV head kh normed (if q_norm) and rotated into qrow, and its key normed and rotated
 * and, with its value, written to its cache slot (slot < 0: not written), as pagoda_norm_rotary and
 * reshape_and_cache compute them. */
static void rotate_and_write(const scalar_t *qkv_row, scalar_t *qrow_r, int64_t kh, int64_t G, int64_t D,
                             int64_t q_size, int64_t kv_size, const scalar_t *q_norm, const scalar_t *k_norm,
                             float eps, int uo, const scalar_t *c, const scalar_t *s, int64_t slot,
                             scalar_t *k_cache, scalar_t *v_cache) {
  for (int64_t g = 0; g < G; g++) {
    const int64_t head = kh * G + g;
    scalar_t *qr = qrow_r + head * D;
    if (q_norm) norm_row(qkv_row + head * D, q_norm, D, eps, uo, qr);
    else memcpy(qr, qkv_row + head * D, sizeof(scalar_t) * (size_t)D);
    rotate_row(qr, c, s, D);
  }
  scalar_t key[MAX_HEAD_DIM];
  if (k_norm) norm_row(qkv_row + q_size + kh * D, k_norm, D, eps, uo, key);
  else memcpy(key, qkv_row + q_size + kh * D, sizeof(scalar_t) * (size_t)D);
  rotate_row(key, c, s, D);
  if (slot >= 0) {
    const int64_t at = slot * kv_size + kh * D;
    memcpy(k_cache + at, key, sizeof(scalar_t) * (size_t)D);
    memcpy(v_cache + at, qkv_row + q_size + kv_size + kh * D, sizeof(scalar_t) * (size_t)D);
  }
}

/* n rounded up to a multiple of 64 (aligned_alloc's sizes). */
static inline size_t aligned64(size_t n) { return (n + 63) / 64 * 64; }

/* Items per (row, KV head) of a one-token step: 1 when there are as many (row, KV head) items as threads, else
 * the fewest equal cuts of the G query heads that give every thread an item (a single KV head, as Gemma 3 270M's,
 * left one of two threads idle through every layer's attention). Cutting 3 KV heads for 2 threads (SmolLM2's)
 * measured slower than one thread attending twice: the items' cost is the keys they read, and the cut adds a
 * barrier. */
static int64_t head_parts(int64_t pairs, int64_t G, int64_t threads) {
  if (pairs >= threads) return 1;
  for (int64_t p = 2; p < G; p++)
    if (G % p == 0 && pairs * p >= threads) return p;
  return G;
}

/* Run `num_layers` decoder layers over x ([rows, hidden], updated in place: the residual stream after the last
 * layer, or with final_norm (not NULL) its norm by those weights, as the fused rms_norm op writes it). Sequence s's new tokens are rows query_start_loc[s] .. query_start_loc[s + 1]
 * (num_seqs sequences; one row each in a plain decode step, the token and its drafts in a speculative one); in a
 * layer of KV cache group g row r's K/V go to cache slot slots[g * rows + r] (negative: not written), and the
 * sequence, context_lens[s] tokens long with its new ones, is read through block_tables[(g * num_seqs + s) *
 * max_blocks ..]; a layer of rope table t rotates row r by cos / sin[(t * rows + r) * head_dim / 2 ..] (x's dtype).
 * Attention runs in the items the prefill kernel cuts (tiles of max(1, TILE_ROWS / G) tokens), so every row's
 * scores are computed as that kernel computes them. unit_offset: Gemma's (1 + w) norms; act_kind: 0 GELU (tanh), 1 SiLU; softcap > 0:
 * attention logit soft-capping. Returns 0, 1 for unsupported sizes, 2 when out of memory. */
int pagoda_decode_layers(const int64_t *table, int64_t num_layers, scalar_t *x, int64_t rows, int64_t hidden,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inner,
                         int64_t block_size, float eps, float scale, int64_t unit_offset, int64_t act_kind,
                         float softcap, const scalar_t *cos, const scalar_t *sin, const int64_t *slots,
                         const int32_t *block_tables, int64_t max_blocks, const int32_t *context_lens,
                         const int32_t *query_start_loc, int64_t num_seqs, int64_t num_threads, int64_t prefetch,
                         const scalar_t *final_norm) {
  const int64_t D = head_dim, q_size = num_heads * D, kv_size = num_kv_heads * D, qkv_n = q_size + 2 * kv_size;
  const int64_t G = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
  if (rows < 1 || rows > DECODE_MAX_ROWS || num_kv_heads < 1 || num_heads % num_kv_heads || G > 32 || D % 8 ||
      D > MAX_HEAD_DIM || block_size < 1 || block_size > MAX_BLOCK_SIZE || hidden % QK || q_size % QK ||
      inner % QK || (act_kind != 0 && act_kind != 1) || num_seqs < 1 || num_seqs > rows ||
      query_start_loc[0] != 0 || query_start_loc[num_seqs] != rows)
    return 1;
  for (int64_t s = 0; s < num_seqs; s++)
    if (query_start_loc[s + 1] <= query_start_loc[s]) return 1;
  if (num_threads < 1) num_threads = 1;
  if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
  /* One token per sequence: each (row, KV head) item writes its key and attends at once, unless there are fewer
   * of those items than threads (one stream of a model with a single KV head: one thread attends alone); then each
   * KV head's query heads are cut into items of part_heads, and the step goes as several tokens per sequence do:
   * every key of the step is written first (a barrier), then the attention items run. A row's output does not
   * depend on the rows its item holds (cpu_attention.c), so neither on the cut. */
  const int64_t cuts = num_seqs == rows ? head_parts(rows * num_kv_heads, G, num_threads) : 1;
  const int64_t part_heads = (G + cuts - 1) / cuts, parts = (G + part_heads - 1) / part_heads;
  const int one_token = num_seqs == rows && parts == 1;
  const int64_t tile = G >= TILE_ROWS ? 1 : TILE_ROWS / G;
  const int64_t widest = hidden > inner ? (hidden > q_size ? hidden : q_size) : (inner > q_size ? inner : q_size);
  /* shared: the step's QKV, attention output, O output, activation and down output, and (several tokens per
   * sequence) the rotated query rows, which other threads' attention items read; and the claim counters, each on
   * its own cache line */
  const size_t shared = sizeof(scalar_t) * (size_t)(rows * (qkv_n + q_size + hidden + inner + hidden + q_size));
  const int uo = (int)unit_offset;
  int64_t *counters = calloc((size_t)(num_layers * PHASES) * 8, sizeof(int64_t));
  scalar_t *buf = malloc(shared);
  /* the attention items: (sequence, KV head, first token, tokens), as pagoda_paged_attention cuts them */
  int64_t num_items = 0;
  for (int64_t s = 0; s < num_seqs; s++)
    num_items += num_kv_heads * parts * ((query_start_loc[s + 1] - query_start_loc[s] + tile - 1) / tile);
  item_t *items = malloc(sizeof(item_t) * (size_t)num_items);
  if (!counters || !buf || !items) {
    free(counters), free(buf), free(items);
    return 2;
  }
  for (int64_t s = 0, i = 0; s < num_seqs; s++) {
    const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
    for (int64_t kh = 0; kh < num_kv_heads; kh++)
      for (int64_t t = 0; t < q_len; t += tile)
        for (int64_t g0 = 0; g0 < G; g0 += part_heads)
          items[i++] = (item_t){s, kh, t, q_len - t < tile ? q_len - t : tile, g0, G - g0 < part_heads ? G - g0 : part_heads};
  }
  scalar_t *qkv = buf, *att = qkv + rows * qkv_n, *o = att + rows * q_size, *act = o + rows * hidden;
  scalar_t *down = act + rows * inner, *qshared = down + rows * hidden;
  int status = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(num_threads)
#endif
  {
#ifdef _OPENMP
    const int64_t thread = omp_get_thread_num(), nthreads = omp_get_num_threads();
#else
    const int64_t thread = 0, nthreads = 1;
#endif
    /* this thread's residual stream, normed rows, quantized x and attention query rows */
    scalar_t *res = malloc(sizeof(scalar_t) * (size_t)(rows * hidden));
    scalar_t *h = malloc(sizeof(scalar_t) * (size_t)(rows * widest));
    scalar_t *qrow = malloc(sizeof(scalar_t) * (size_t)(rows * q_size));
    qx_t qx;
    qx.q = malloc((size_t)(rows * widest));
    qx.d = malloc(sizeof(float) * (size_t)(rows * widest / QK));
    qx.s = malloc(sizeof(int32_t) * (size_t)(rows * widest / QK));
    qx.g = aligned_alloc(64, sizeof(xquad) * (size_t)(rows * quad_groups(widest)));
    const int64_t vec_blocks = rows > MAX_ROWS ? (rows + FMA_MT - 1) / FMA_MT : 0; /* 4-byte slots <= widest */
    qx.xp = vec_blocks ? aligned_alloc(64, aligned64(4 * (size_t)(vec_blocks * FMA_MT * widest))) : NULL;
    qx.panel = vec_blocks ? aligned_alloc(64, aligned64(4 * (size_t)(FMA_PANEL * widest))) : NULL;
    qx.acc = vec_blocks ? aligned_alloc(64, aligned64(sizeof(float) * (size_t)(vec_blocks * FMA_PANEL * FMA_MT)))
                        : NULL;
    const int vec_ok = !vec_blocks || (qx.xp && qx.panel && qx.acc);
#if PATH == 2
    qx.xb = aligned_alloc(32, sizeof(xblock) * (size_t)(widest / QK));
    qx.r = malloc((size_t)(rows * widest));
    const int ok = res && h && qrow && qx.q && qx.d && qx.s && qx.g && qx.xb && qx.r && vec_ok;
#else
    qx.r = qx.q;
    const int ok = res && h && qrow && qx.q && qx.d && qx.s && qx.g && vec_ok;
#endif
    if (!ok) __atomic_store_n(&status, 2, __ATOMIC_RELAXED);
    team_barrier(); /* every thread knows whether all allocations succeeded */
    if (__atomic_load_n(&status, __ATOMIC_RELAXED) == 0) {
      memcpy(res, x, sizeof(scalar_t) * (size_t)(rows * hidden));
      const problem_t base = {qrow, NULL, NULL, NULL, NULL, att, block_tables, query_start_loc, context_lens, max_blocks,
                              num_heads, num_kv_heads, D, block_size, 0, scale, softcap > 0.0f ? softcap : 0.0f};
      for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *f = table + l * LAYER_FIELDS;
#define NORM_AT(field) ((const scalar_t *)(intptr_t)f[field])
        const scalar_t *in_norm = NORM_AT(F_INPUT_NORM), *attn_out_norm = NORM_AT(F_ATTN_OUT_NORM);
        const scalar_t *mlp_norm = NORM_AT(F_MLP_NORM), *mlp_out_norm = NORM_AT(F_MLP_OUT_NORM);
        const scalar_t *q_norm = NORM_AT(F_Q_NORM), *k_norm = NORM_AT(F_K_NORM);
#undef NORM_AT
        const int64_t group = f[F_GROUP], rope = f[F_ROPE];
        const int64_t *gslots = slots + group * rows;
        const scalar_t *gcos = cos + rope * rows * (D / 2), *gsin = sin + rope * rows * (D / 2);
        scalar_t *k_cache = (scalar_t *)(intptr_t)f[F_K_CACHE], *v_cache = (scalar_t *)(intptr_t)f[F_V_CACHE];
        const qweight_t wqkv = weight_at(f + F_QKV), wo = weight_at(f + F_O), wgu = weight_at(f + F_GATE_UP);
        const qweight_t wdown = weight_at(f + F_DOWN);
        int64_t *count = counters + l * PHASES * 8;
        int64_t j0, n;
        /* input norm and QKV */
        for (int64_t r = 0; r < rows; r++) norm_row(res + r * hidden, in_norm, hidden, eps, uo, h + r * hidden);
        quantize_x(h, hidden, rows, hidden, &wqkv, &qx);
        while ((n = claim(count, qkv_n, nthreads, 16, 512, &j0)) > 0)
          weight_columns(&wqkv, j0, j0 + n, hidden, &qx, rows, qkv, qkv_n);
        team_barrier();
        problem_t p = base;
        p.k_cache = k_cache, p.v_cache = v_cache, p.window = f[F_WINDOW];
        p.block_tables = block_tables + group * num_seqs * max_blocks;
        if (one_token) { /* per (row, KV head): rotary of its query heads and key, the K/V write, attention */
          while (claim(count + 8, rows * num_kv_heads, nthreads, 1, 1, &j0) > 0) {
            const int64_t r = j0 / num_kv_heads, kh = j0 % num_kv_heads;
            rotate_and_write(qkv + r * qkv_n, qrow + r * q_size, kh, G, D, q_size, kv_size, q_norm, k_norm, eps, uo,
                             gcos + r * (D / 2), gsin + r * (D / 2), gslots[r], k_cache, v_cache);
            attend_rows(&p, &items[j0], G);
          }
        } else { /* every row's rotary and K/V write, then the attention items over them (any thread's rows) */
          while (claim(count + 40, rows * num_kv_heads, nthreads, 1, 1, &j0) > 0) {
            const int64_t r = j0 / num_kv_heads, kh = j0 % num_kv_heads;
            rotate_and_write(qkv + r * qkv_n, qshared + r * q_size, kh, G, D, q_size, kv_size, q_norm, k_norm, eps,
                             uo, gcos + r * (D / 2), gsin + r * (D / 2), gslots[r], k_cache, v_cache);
          }
          team_barrier();
          p.q = qshared;
          while (claim(count + 8, num_items, nthreads, 1, 1, &j0) > 0)
            attend_rows(&p, &items[j0], items[j0].num_tokens * items[j0].num_group_heads);
        }
        if (prefetch) prefetch_share(&wo, q_size, thread, nthreads, 1 << 18);
        team_barrier();
        /* output projection, residual add and post-attention norm */
        quantize_x(att, q_size, rows, q_size, &wo, &qx);
        while ((n = claim(count + 16, hidden, nthreads, 16, 512, &j0)) > 0)
          weight_columns(&wo, j0, j0 + n, q_size, &qx, rows, o, hidden);
        team_barrier();
        for (int64_t r = 0; r < rows; r++) { /* as pagoda_add_norm, with Gemma's norm of the branch first */
          const scalar_t *branch = o + r * hidden;
          if (attn_out_norm) {
            norm_row(branch, attn_out_norm, hidden, eps, uo, h + r * hidden);
            branch = h + r * hidden;
          }
          add_rows(res + r * hidden, branch, res + r * hidden, hidden);
          norm_row(res + r * hidden, mlp_norm, hidden, eps, uo, h + r * hidden);
        }
        /* gate and up columns j.. of both halves, then SiLU(gate) * up of those columns */
        quantize_x(h, hidden, rows, hidden, &wgu, &qx);
        while ((n = claim(count + 24, inner, nthreads, 16, ACT_CHUNK, &j0)) > 0) {
          scalar_t gate[DECODE_MAX_ROWS * ACT_CHUNK], up[DECODE_MAX_ROWS * ACT_CHUNK];
          weight_columns(&wgu, j0, j0 + n, hidden, &qx, rows, gate - j0, ACT_CHUNK);
          weight_columns(&wgu, inner + j0, inner + j0 + n, hidden, &qx, rows, up - inner - j0, ACT_CHUNK);
          for (int64_t r = 0; r < rows; r++)
            act_mul(gate + r * ACT_CHUNK, up + r * ACT_CHUNK, act + r * inner + j0, n, (int)act_kind);
        }
        team_barrier();
        /* down projection and residual add */
        quantize_x(act, inner, rows, inner, &wdown, &qx);
        while ((n = claim(count + 32, hidden, nthreads, 16, 512, &j0)) > 0)
          weight_columns(&wdown, j0, j0 + n, inner, &qx, rows, down, hidden);
        if (prefetch && l + 1 < num_layers) {
          const qweight_t next = weight_at(table + (l + 1) * LAYER_FIELDS + F_QKV);
          prefetch_share(&next, hidden, thread, nthreads, 1 << 18);
        }
        team_barrier();
        for (int64_t r = 0; r < rows; r++) {
          const scalar_t *branch = down + r * hidden;
          if (mlp_out_norm) { /* x + norm(mlp(x)): the norm, rounded, then the add */
            norm_row(branch, mlp_out_norm, hidden, eps, uo, h + r * hidden);
            branch = h + r * hidden;
          }
          add_rows(res + r * hidden, branch, res + r * hidden, hidden);
        }
      }
      if (thread == 0 && final_norm)
        for (int64_t r = 0; r < rows; r++) norm_row(res + r * hidden, final_norm, hidden, eps, uo, x + r * hidden);
      else if (thread == 0)
        memcpy(x, res, sizeof(scalar_t) * (size_t)(rows * hidden));
    }
    free(res), free(h), free(qrow), free(qx.q), free(qx.d), free(qx.s), free(qx.g);
    free(qx.xp), free(qx.panel), free(qx.acc);
#if PATH == 2
    free(qx.xb), free(qx.r);
#endif
  }
  free(counters), free(buf), free(items);
  return status;
}
