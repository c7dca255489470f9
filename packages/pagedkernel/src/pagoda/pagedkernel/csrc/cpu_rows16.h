/* Q8_0_R16: Q8_0 weights repacked sixteen rows (output columns) to a tile, times int8 rows of x (included by
 * cpu_quant.c; the layout's specification is pagoda/pagedkernel/quant/repack.py).
 *
 * Why: the quad order reads one weight row at a time and sums its lanes across (a horizontal sum per output), so
 * from a few rows of x it is bound by instructions at ~40-45% of the int8 dot-product peak. Here a 512-bit register
 * holds four k of sixteen columns, so each vpdpbusd is sixteen outputs' four products with x's four bytes
 * broadcast, and y leaves sixteen columns at a time with no horizontal sum. Measured on a 2-core AMD EPYC Zen 4
 * (a stand-alone prototype, float32 scales): SmolLM2's 49,152 x 576 Q8_0 head at 16 rows 2.38 -> 1.03 ms (about
 * the int8 peak), Gemma 3's 262,144 x 640 at 32 rows 21.0 ms (the bfloat16 vector path) -> 14.2 ms.
 *
 * Layout: rows in tiles of sixteen (the last tile holds the n % 16 rows left, W of them); a tile of W rows keeps
 * the 34 W bytes of each 32-element block b together: the W rows' float16 scales, then the bytes q + 128 (q the
 * signed Q8_0 value) as [8 groups of 4 elements][W rows][4 bytes]. A tile of W rows starts where row 16 t would in
 * Q8_0 (the same bytes in all).
 *
 * The arithmetic, the same on every path (AVX-512 VNNI, plain C), so every path and any number of rows give
 * bitwise the same y (tested): for row r of x and column c, L_b = the exact integer sum over block b of
 * (u - 128) q (x's signed q; on the VNNI path sum u q less 128 sum q, the same integer), then
 * acc = fma((float)L_b, d_cb * dx_rb, acc) in block order from 0, and y = acc (rounded to bfloat16 where asked).
 */

#define R16_TILE 16
#define R16_TYPE(t) ((t) == Q8_0_R16)

/* x's rows as the tiles read them: signed q (the VNNI path's quantize_row writes q + 128 for the other formats'
 * products; here the weights are the unsigned operand). */
static void prepare_r16(int8_t *xq, int64_t n) {
#if PATH == 2
  for (int64_t i = 0; i < n; i++) xq[i] = (int8_t)((uint8_t)xq[i] ^ 0x80u);
#else
  (void)xq, (void)n;
#endif
}

/* y[r, col + c] = v[c] for c < w, rows of y y_stride apart, float32 or rounded to bfloat16. */
INLINE void r16_store(const float *v, int w, void *y, int64_t index, int y_bf16) {
  for (int c = 0; c < w; c++) store_value(v[c], y, index + c, y_bf16);
}

#if PATH == 2
/* One tile of W <= 16 columns (tw its bytes) for rows r0 .. r0 + R of x (R a constant once inlined): per block,
 * each row's sixteen lane sums start at -128 sum q and take eight vpdpbusd (weights by x's four bytes broadcast),
 * then one conversion and one fused multiply-add by d * dx. */
INLINE void r16_tile(const int R, const uint8_t *tw, int w, int64_t blocks, const int8_t *xq, const float *xd,
                     const int32_t *xs, int64_t k, int64_t r0, void *y, int64_t y_stride, int64_t col, int y_bf16,
                     int prefetch) {
  const __mmask16 m = (__mmask16)((1u << w) - 1u);
  const int64_t block_bytes = 34 * (int64_t)w, group = 4 * (int64_t)w;
  __m512 acc[8];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t *tb = tw + b * block_bytes;
    if (prefetch) prefetch_ahead(tb, block_bytes);
    __m512i s[8];
    for (int r = 0; r < R; r++) s[r] = _mm512_set1_epi32(-128 * xs[(r0 + r) * (k / QK) + b]);
    const uint8_t *u = tb + 2 * w;
    for (int g = 0; g < 8; g++) {
      const __m512i wv = _mm512_maskz_loadu_epi32(m, u + g * group);
      for (int r = 0; r < R; r++) {
        int32_t x4;
        memcpy(&x4, xq + (r0 + r) * k + b * QK + 4 * g, sizeof x4);
        s[r] = _mm512_dpbusd_epi32(s[r], wv, _mm512_set1_epi32(x4));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, tb));
    for (int r = 0; r < R; r++) {
      const __m512 f = _mm512_mul_ps(d, _mm512_set1_ps(xd[(r0 + r) * (k / QK) + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), f, acc[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    float v[R16_TILE];
    _mm512_storeu_ps(v, acc[r]);
    r16_store(v, w, y, (r0 + r) * y_stride + col, y_bf16);
  }
}
#else
/* The plain form of the same arithmetic, one row of x. */
static void r16_tile_row(const uint8_t *tw, int w, int64_t blocks, const int8_t *xr, const float *xdr, void *y,
                         int64_t index, int y_bf16) {
  const int64_t block_bytes = 34 * (int64_t)w;
  float acc[R16_TILE] = {0};
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t *tb = tw + b * block_bytes, *u = tb + 2 * w;
    for (int c = 0; c < w; c++) {
      int32_t l = 0;
      for (int g = 0; g < 8; g++)
        for (int e = 0; e < 4; e++) l += ((int32_t)u[g * 4 * w + 4 * c + e] - 128) * (int32_t)xr[b * QK + 4 * g + e];
      acc[c] = fmaf((float)l, f16(tb + 2 * c) * xdr[b], acc[c]);
    }
  }
  r16_store(acc, w, y, index, y_bf16);
}
#endif

/* Columns j0..j1 of y (j0 a multiple of 16; j1 one too, or the last column) for every row of x: tile by tile, the
 * rows in passes of up to eight (their sums in registers) while the tile's bytes stay in L1. */
static void columns_Q8_0_R16(const uint8_t *weight, int64_t j0, int64_t j1, int64_t k, const int8_t *xq,
                             const float *xd, const int32_t *xs, const xquad *xg, int64_t rows, void *y,
                             int64_t y_stride, int y_bf16) {
  (void)xg;
  const int64_t blocks = k / QK, row_bytes = blocks * 34;
#if PATH == 2
  prefetch_start(weight + j0 * row_bytes);
#else
  (void)xs;
#endif
  for (int64_t j = j0; j < j1; j += R16_TILE) {
    const int w = (int)(j1 - j < R16_TILE ? j1 - j : R16_TILE);
    const uint8_t *tw = weight + j * row_bytes;
#if PATH == 2
    for (int64_t r0 = 0; r0 < rows; r0 += FEW_ROWS) {
#define R16(R) r16_tile(R, tw, w, blocks, xq, xd, xs, k, r0, y, y_stride, j, y_bf16, r0 == 0)
      FOR_PASS_ROWS(rows, r0, FEW_ROWS, R16)
#undef R16
    }
#else
    for (int64_t r = 0; r < rows; r++) r16_tile_row(tw, w, blocks, xq + r * k, xd + r * blocks, y, r * y_stride + j, y_bf16);
#endif
  }
}
