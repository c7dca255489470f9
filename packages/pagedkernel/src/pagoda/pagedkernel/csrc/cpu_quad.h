/* The quad order: Q4_1 weights times int8 rows of x, four blocks (128 elements) at a time (included by cpu_quant.c).
 *
 * Why: at one row a Q4_1 GEMV is bound by the instructions per 32-element block, not by memory. The per-block form
 * (block32 + one_row_step) spends ~22 instructions on 20 bytes: two scalar half conversions, a broadcast, the
 * minimum's scalar product, and eight float lanes per block. Measured on a 2-core AMD EPYC Zen 4, the default
 * model's 30 layers of Q4_1 GEMVs (66 MB) took 3.0 ms with the weights in cache and 3.3 ms from DRAM (a plain
 * read of the same bytes: 1.8 ms). Four blocks at a time: one byte permute gathers their 64 bytes of nibbles, one
 * word permute their scales and minima (one half-to-float conversion for eight), and each float lane sums eight
 * products of a block (its quarter of elements 0..15 and the same quarter of 16..31) instead of four: 1.3 ms in
 * cache, 2.1 ms from DRAM.
 *
 * The arithmetic, the same on every path (AVX-512 VBMI with VNNI, AVX2 with or without VNNI, plain C), so that
 * every path and any number of rows give bitwise the same y (tested):
 *   - blocks are taken in groups of four (the last group may be short: its missing blocks add nothing);
 *   - lane 4 jj + l (jj the block in its group, l = 0..3) of 16 float lanes: acc += (float)L * (d * dx), L the
 *     exact integer sum of w q over elements 4l..4l+3 and 16+4l..16+4l+3 of block jj, d its scale, dx x's;
 *   - the minimum's term per block: o[jj] += m * (dx * (float)qsum), qsum the sum of x's q over the block;
 *     (in the vectors d, m of a group are the words [d0, m0, .., d3, m3], each block's halves as stored, and x's
 *     factors [dx0, dx0 qsum0, ..]: one multiply gives both products of all four blocks);
 *   - y = tree(acc) + tree(o): acc[i] + acc[i + 8], then + [i + 4], + [i + 2], + [i + 1]; o[0] + o[2] and
 *     o[1] + o[3], then their sum (the additions a vector reduction makes, written out for the plain path).
 */

#define QUAD_TYPE(t) ((t) == Q4_1)
#define QUAD_BLOCK_BYTES 20 /* Q4_1: half d, half m, 16 bytes of nibbles */

/* One group of four blocks of a row of x in the form every path reads: q (signed) of each block's elements 0..15
 * and 16..31, four blocks side by side, then each block's dx and dx * qsum (interleaved). */
typedef struct {
  int8_t lo[64], hi[64];
  float s[8];
} __attribute__((aligned(64))) xquad;

/* Groups of four blocks of a row of k elements (the last one short where k / 32 is not a multiple of 4). */
static inline int64_t quad_groups(int64_t k) { return (k / QK + 3) / 4; }

/* The quad form of one quantized row (quantize_row's q, dx and qsum: q stored + 128 on the VNNI path). */
static void prepare_quad(const int8_t *xq, const float *xd, const int32_t *xs, int64_t k, xquad *g) {
  const int64_t blocks = k / QK;
  for (int64_t gi = 0; gi < quad_groups(k); gi++) {
    xquad *x = g + gi;
    memset(x, 0, sizeof *x);
    for (int64_t jj = 0; jj < 4 && 4 * gi + jj < blocks; jj++) {
      const int64_t b = 4 * gi + jj;
#if PATH == 2
      const __m128i top = _mm_set1_epi8((char)0x80);
      _mm_storeu_si128((__m128i *)(x->lo + 16 * jj),
                       _mm_xor_si128(_mm_loadu_si128((const __m128i *)(xq + b * QK)), top));
      _mm_storeu_si128((__m128i *)(x->hi + 16 * jj),
                       _mm_xor_si128(_mm_loadu_si128((const __m128i *)(xq + b * QK + 16)), top));
#else
      memcpy(x->lo + 16 * jj, xq + b * QK, 16);
      memcpy(x->hi + 16 * jj, xq + b * QK + 16, 16);
#endif
      x->s[2 * jj] = xd[b];
      x->s[2 * jj + 1] = xd[b] * (float)xs[b];
    }
  }
}

/* tree(acc) + tree(o), as the header says. */
static inline float quad_reduce(const float acc[16], const float o[4]) {
  float t8[8], t4[4], t2[2];
  for (int i = 0; i < 8; i++) t8[i] = acc[i] + acc[i + 8];
  for (int i = 0; i < 4; i++) t4[i] = t8[i] + t8[i + 4];
  for (int i = 0; i < 2; i++) t2[i] = t4[i] + t4[i + 2];
  const float u0 = o[0] + o[2], u1 = o[1] + o[3];
  return (t2[0] + t2[1]) + (u0 + u1);
}

/* One column of one row in plain C: the specification the vector paths follow. */
static float quad_dot(const uint8_t *w, int64_t blocks, const xquad *g) {
  float acc[16] = {0}, o[4] = {0};
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t *blk = w + b * QUAD_BLOCK_BYTES, *qs = blk + 4;
    const xquad *x = g + b / 4;
    const int jj = (int)(b % 4);
    const float s = f16(blk) * x->s[2 * jj], mo = f16(blk + 2) * x->s[2 * jj + 1];
    for (int l = 0; l < 4; l++) {
      int32_t lane = 0;
      for (int e = 4 * l; e < 4 * l + 4; e++)
        lane += (int32_t)(qs[e] & 0x0F) * x->lo[16 * jj + e] + (int32_t)(qs[e] >> 4) * x->hi[16 * jj + e];
      acc[4 * jj + l] = acc[4 * jj + l] + (float)lane * s;
    }
    o[jj] = o[jj] + mo;
  }
  return quad_reduce(acc, o);
}

#if PATH >= 1
/* The sum the plain path's quad_reduce makes, of 16 lanes as two halves (lanes 0..7, 8..15) and the minima's
 * terms in the odd lanes of o ([., o0, ., o1, ., o2, ., o3]). */
INLINE float quad_reduce_v(__m256 lo, __m256 hi, __m256 o) {
  const __m256 t8 = _mm256_add_ps(lo, hi);
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  const __m128 u4 = _mm_add_ps(_mm256_castps256_ps128(o), _mm256_extractf128_ps(o, 1)); /* lanes 1, 3: o0+o2, o1+o3 */
  const __m128 u2 = _mm_shuffle_ps(u4, u4, _MM_SHUFFLE(3, 3, 3, 1));
  const __m128 t1 = _mm_add_ss(t2, _mm_movehdup_ps(t2)), u1 = _mm_add_ss(u2, _mm_movehdup_ps(u2));
  return _mm_cvtss_f32(_mm_add_ss(t1, u1));
}
#endif

#if PATH == 2 && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define QUAD_512 1
/* A group's weights: nibbles of elements 0..15 (lo) and 16..31 (hi) of its four blocks side by side, and the
 * blocks' d and m as floats ([d0, m0, .., d3, m3]). `have` blocks are read (4 but in a short last group). */
INLINE void quad_weights(const uint8_t *w, int have, __m512i *lo, __m512i *hi, __m256 *dm) {
  /* byte p of the nibbles: block p / 16's byte p % 16; words 10 jj and 10 jj + 1: block jj's d and m */
  const __m512i qidx = _mm512_set_epi8(
      79, 78, 77, 76, 75, 74, 73, 72, 71, 70, 69, 68, 67, 66, 65, 64, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48,
      47, 46, 45, 44, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 19, 18, 17, 16, 15, 14, 13, 12,
      11, 10, 9, 8, 7, 6, 5, 4);
  const __m512i widx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 31,
                                        30, 21, 20, 11, 10, 1, 0);
  __m512i a, b;
  if (have == 4) {
    a = _mm512_loadu_si512(w);
    b = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(w + 64)));
  } else { /* a short last group: its missing blocks read as zeros (no byte past the row is touched) */
    a = _mm512_maskz_loadu_epi8(_cvtu64_mask64((1ull << (QUAD_BLOCK_BYTES * have)) - 1), w);
    b = _mm512_setzero_si512();
  }
  const __m512i q = _mm512_permutex2var_epi8(a, qidx, b), m4 = _mm512_set1_epi8(0x0F);
  *lo = _mm512_and_si512(q, m4);
  *hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
  *dm = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi16(widx, a)));
}

/* One row's step on a group: the lanes, scaled by d * dx, into acc; d * dx and m * dx * qsum into o. */
INLINE void quad_step(__m512 *acc, __m256 *o, __m512i lo, __m512i hi, __m256 dm, const xquad *x) {
  const __m512i sidx = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  const __m512i lanes = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(x->lo)),
                                            hi, _mm512_load_si512(x->hi));
  const __m256 s = _mm256_mul_ps(dm, _mm256_load_ps(x->s));
  *acc = _mm512_add_ps(*acc, _mm512_mul_ps(_mm512_cvtepi32_ps(lanes), _mm512_permutexvar_ps(sidx, _mm512_castps256_ps512(s))));
  *o = _mm256_add_ps(*o, s);
}

/* C columns (at w, C * ... row_bytes apart) times R rows of x (groups apart), into y: R * C sums in registers. */
INLINE void quad_tile(const int C, const int R, const uint8_t *w, int64_t row_bytes, int64_t k, const xquad *g,
                      int64_t groups, void *y, int64_t index, int64_t y_stride, int y_bf16) {
  const int64_t blocks = k / QK;
  __m512 acc[2][FEW_ROWS];
  __m256 o[2][FEW_ROWS];
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++) acc[c][r] = _mm512_setzero_ps(), o[c][r] = _mm256_setzero_ps();
  for (int64_t gi = 0; gi < groups; gi++) {
    const int have = blocks - 4 * gi < 4 ? (int)(blocks - 4 * gi) : 4;
    for (int c = 0; c < C; c++) {
      __m512i lo, hi;
      __m256 dm;
      quad_weights(w + c * row_bytes + gi * 4 * QUAD_BLOCK_BYTES, have, &lo, &hi, &dm);
      for (int r = 0; r < R; r++) quad_step(&acc[c][r], &o[c][r], lo, hi, dm, g + r * groups + gi);
    }
  }
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++) {
      const __m512 a = acc[c][r];
      const float v = quad_reduce_v(_mm512_castps512_ps256(a),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)), o[c][r]);
      store_value(v, y, r * y_stride + index + c, y_bf16);
    }
}
#elif PATH >= 1
/* A group's weights as two pairs of blocks (0, 1 and 2, 3): nibbles of elements 0..15 (lo) and 16..31 (hi) of
 * the pair side by side, and the blocks' d and m as floats ([d0, m0, .., d3, m3]); missing blocks read as zeros. */
INLINE void quad_weights(const uint8_t *w, int have, __m256i lo[2], __m256i hi[2], __m256 *dm) {
  __m128i qs[4], dmh;
  if (have == 4) {
    for (int jj = 0; jj < 4; jj++) qs[jj] = _mm_loadu_si128((const __m128i *)(w + jj * QUAD_BLOCK_BYTES + 4));
    dmh = _mm_setr_epi32((int)u32le(w), (int)u32le(w + 20), (int)u32le(w + 40), (int)u32le(w + 60));
  } else {
    uint32_t h[4] = {0};
    for (int jj = 0; jj < 4; jj++) {
      qs[jj] = jj < have ? _mm_loadu_si128((const __m128i *)(w + jj * QUAD_BLOCK_BYTES + 4)) : _mm_setzero_si128();
      if (jj < have) h[jj] = u32le(w + jj * QUAD_BLOCK_BYTES);
    }
    dmh = _mm_loadu_si128((const __m128i *)h);
  }
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int p = 0; p < 2; p++) {
    const __m256i q = _mm256_set_m128i(qs[2 * p + 1], qs[2 * p]);
    lo[p] = _mm256_and_si256(q, m4);
    hi[p] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
  }
  *dm = _mm256_cvtph_ps(dmh);
}

/* The integer lanes of a pair: unsigned nibbles by signed q, exact (15 * 127 * 2 fits a 16-bit pair sum). */
INLINE __m256i quad_lanes(__m256i lo, __m256i hi, const int8_t *xlo, const int8_t *xhi) {
  const __m256i a = _mm256_loadu_si256((const __m256i *)xlo), b = _mm256_loadu_si256((const __m256i *)xhi);
#if PATH == 2
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, a), hi, b);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, a), ones),
                          _mm256_madd_epi16(_mm256_maddubs_epi16(hi, b), ones));
#endif
}

INLINE void quad_step(__m256 acc[2], __m256 *o, const __m256i lo[2], const __m256i hi[2], __m256 dm, const xquad *x) {
  const __m256 s = _mm256_mul_ps(dm, _mm256_load_ps(x->s));
  for (int p = 0; p < 2; p++) {
    const __m256i lanes = quad_lanes(lo[p], hi[p], x->lo + 32 * p, x->hi + 32 * p);
    const int a = 4 * p, b = 4 * p + 2; /* d * dx of the pair's blocks */
    const __m256 sp = _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(a, a, a, a, b, b, b, b));
    acc[p] = _mm256_add_ps(acc[p], _mm256_mul_ps(_mm256_cvtepi32_ps(lanes), sp));
  }
  *o = _mm256_add_ps(*o, s);
}

INLINE void quad_tile(const int C, const int R, const uint8_t *w, int64_t row_bytes, int64_t k, const xquad *g,
                      int64_t groups, void *y, int64_t index, int64_t y_stride, int y_bf16) {
  const int64_t blocks = k / QK;
  __m256 acc[2][FEW_ROWS][2];
  __m256 o[2][FEW_ROWS];
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++) acc[c][r][0] = acc[c][r][1] = o[c][r] = _mm256_setzero_ps();
  for (int64_t gi = 0; gi < groups; gi++) {
    const int have = blocks - 4 * gi < 4 ? (int)(blocks - 4 * gi) : 4;
    for (int c = 0; c < C; c++) {
      __m256i lo[2], hi[2];
      __m256 dm;
      quad_weights(w + c * row_bytes + gi * 4 * QUAD_BLOCK_BYTES, have, lo, hi, &dm);
      for (int r = 0; r < R; r++) quad_step(acc[c][r], &o[c][r], lo, hi, dm, g + r * groups + gi);
    }
  }
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++)
      store_value(quad_reduce_v(acc[c][r][0], acc[c][r][1], o[c][r]), y, r * y_stride + index + c, y_bf16);
}
#endif

/* Columns j0..j1 of y for any rows of a quad-order format: rows in passes of FEW_ROWS, one row two columns at a
 * time (two independent sum chains); the plain path one output at a time. */
INLINE void quad_columns(const uint8_t *weight, int64_t j0, int64_t j1, int64_t k, const xquad *g, int64_t rows,
                         void *y, int64_t y_stride, int y_bf16) {
  const int64_t groups = quad_groups(k), row_bytes = k / QK * QUAD_BLOCK_BYTES;
#if PATH >= 1
  prefetch_start(weight + j0 * row_bytes);
  int64_t j = j0;
  if (rows == 1)
    for (; j + 2 <= j1; j += 2) {
      prefetch_ahead(weight + j * row_bytes, 2 * row_bytes);
      quad_tile(2, 1, weight + j * row_bytes, row_bytes, k, g, groups, y, j, y_stride, y_bf16);
    }
  for (; j < j1; j++) {
    const uint8_t *wrow = weight + j * row_bytes;
    prefetch_ahead(wrow, row_bytes);
    for (int64_t r0 = 0; r0 < rows; r0 += FEW_ROWS) {
      const xquad *gr = g + r0 * groups;
      void *yr = (char *)y + (size_t)(r0 * y_stride) * (y_bf16 ? sizeof(uint16_t) : sizeof(float));
#define QUAD(R) quad_tile(1, R, wrow, row_bytes, k, gr, groups, yr, j, y_stride, y_bf16)
      FOR_PASS_ROWS(rows, r0, QUAD)
#undef QUAD
    }
  }
#else
  for (int64_t j = j0; j < j1; j++)
    for (int64_t r = 0; r < rows; r++)
      store_value(quad_dot(weight + j * row_bytes, k / QK, g + r * groups), y, r * y_stride + j, y_bf16);
#endif
}
