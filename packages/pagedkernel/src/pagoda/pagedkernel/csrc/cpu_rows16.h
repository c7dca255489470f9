/* Q8_0_R16, Q4_1_R16, Q5_0_R16, Q4_K_R16, Q6_K_R16: Q8_0, Q4_1, Q5_0, Q4_K and Q6_K weights repacked sixteen rows
 * (output columns) to a tile, times int8 rows of x (included by cpu_quant.c; the layouts' specification is
 * pagoda/pagedkernel/quant/repack.py).
 *
 * Why: the quad order reads one weight row at a time and sums its lanes across (a horizontal sum per output), so
 * from a few rows of x it is bound by instructions at ~40-45% of the int8 dot-product peak. Here a 512-bit register
 * holds four k of sixteen columns, so each vpdpbusd is sixteen outputs' four products with x's four bytes
 * broadcast, and y leaves sixteen columns at a time with no horizontal sum. Measured on a 2-core AMD EPYC Zen 4:
 * SmolLM2's 49,152 x 576 Q8_0 head at 16 rows 2.08 -> 1.05 ms (about the int8 peak), Gemma 3's 262,144 x 640 at 32
 * rows ~21 ms (the bfloat16 vector path) -> 12.4 ms.
 *
 * Layout: rows in tiles of sixteen (the last tile holds the n % 16 rows left, W of them); a tile of W rows keeps
 * each 32-element block of its rows together, W times the format's bytes per block: the W rows' float16 scales d
 * (Q4_1: then their minima m), then the unsigned values u of element 4 g + e (group g = 0..7, e = 0..3) of row c:
 *   - Q8_0: bytes u = q + 128 as [8 groups][W rows][4];
 *   - Q4_1 (u the nibble), Q5_0 (u the 5-bit value, q + 16): bytes [4 pairs p][W rows][4] holding u & 15 of group
 *     2p in the low nibble and of group 2p + 1 in the high one; Q5_0 then 4 W bytes of fifth bits, bit
 *     (g W + c) 4 + e of the little-endian bit string being bit 4 of that u.
 * Q4_K_R16 keeps each 256-element super-block of the W rows together (144 W bytes): the W rows' float16 d, then
 * their float16 dmin, then 8 W bytes [sub-block j][W rows] holding the low four bits of the 6-bit scale sc_j (low
 * nibble) and of the minimum m_j (high nibble), then W little-endian 32-bit words of their high two bits (bits
 * 2 j: sc_j's, bits 16 + 2 j: m_j's), then each of the eight 32-element sub-blocks' nibbles as Q4_1_R16's values;
 * a sub-block's d is d * sc_j and its minimum -(dmin * m_j), both exact in float32. Q6_K_R16 likewise (210 W bytes):
 * the W rows' float16 d, their signed 8-bit scales [16 sub-blocks of 16][W], then per 32-element block its low four
 * bits as Q4_1_R16's values and 8 W bytes [2 quads of groups][W rows][4] whose bits 2 i hold the high two bits of
 * group 4 quad + i's element; u = q + 32, and each half of a block takes its own d * sc (exact).
 * A tile of W rows starts where row 16 t would in the source format (the same bytes in all).
 *
 * The arithmetic, the same on every path (AVX-512 VNNI, plain C), so every path and any number of rows give
 * bitwise the same y (tested): for row r of x and column c, per block b in order from acc = 0,
 * L = the exact integer sum of (u - z) q over the block (z = 128, 0, 16; x's signed q; the VNNI path sums u q from
 * -z sum q, the same integer), acc = fma((float)L, d * dx, acc), and for Q4_1 and Q4_K then acc = fma(m,
 * dx * (float)sum q, acc); for Q6_K L and d per half of the block (elements 0-15, then 16-31), two such fused
 * multiply-adds; y = acc (rounded to bfloat16 where asked). Q6_K's VNNI products take x as the unsigned operand
 * (q + 128, the form quantize_row writes there) and the signed u - z, less 128 times the half's sum of u - z.
 */

#define R16_TILE 16
#define R16_ROW_BLOCK_BYTES (256 * 1024) /* x's int8 rows per block of many rows: half a Zen 4 L2 */
#define R16_PASS 8 /* rows of x whose sums stay in registers over a tile (FEW_ROWS on the VNNI path) */
#define R16_TYPE(t) ((t) == Q8_0_R16 || (t) == Q4_1_R16 || (t) == Q5_0_R16 || (t) == Q4_K_R16 || (t) == Q6_K_R16)
#define R16_K(t) ((t) == Q4_K_R16 || (t) == Q6_K_R16) /* super-blocks of 256 elements */
/* Whether the kernel reads x's signed q (r16_signed_x), not the VNNI path's unsigned q + 128 (Q6_K: see above). */
#define R16_SIGNED_X(t) (R16_TYPE(t) && (t) != Q6_K_R16)
#define R16_MIN(t) ((t) == Q4_1_R16 || (t) == Q4_K_R16) /* blocks with a minimum */
#define R16_HALF_SCALES(t) ((t) == Q6_K_R16) /* a scale per 16-element half of a block */
/* AVX2: groups whose 16-bit vpmaddubsw pair sums add without overflow (u <= 15: 8, u <= 31: 4, u <= 63: 2) */
#define R16_RUN(t) ((t) == Q5_0_R16 ? 4 : (t) == Q6_K_R16 ? 2 : 8)
/* Bytes per row and block (not K layouts); bytes of float16 fields (d, and Q4_1's m) per row and block; what u adds
 * to the value (z); a K layout's bytes per row and super-block, and before its first block's values. */
#define R16_BYTES(t) ((t) == Q8_0_R16 ? 34 : (t) == Q4_1_R16 ? 20 : 22)
#define R16_HALVES(t) ((t) == Q4_1_R16 ? 4 : 2)
#define R16_BIAS(t) ((t) == Q8_0_R16 ? 128 : (t) == Q5_0_R16 ? 16 : (t) == Q6_K_R16 ? 32 : 0)
#define R16_K_BYTES(t) ((t) == Q4_K_R16 ? 144 : 210)
#define R16_K_HEAD(t) ((t) == Q4_K_R16 ? 16 : 18)
#define R16_K_BLOCK(t) ((t) == Q4_K_R16 ? 16 : 24) /* a 32-element block's values per row */
/* Bytes of a row of k elements (of every row: a tile of W rows is W times this). */
#define R16_ROW_BYTES(t, k) (R16_K(t) ? (k) / QK_K * R16_K_BYTES(t) : (k) / QK * R16_BYTES(t))

/* Block b's values (u) in a tile tw of W rows. */
static inline const uint8_t *r16_values(const int64_t type, const uint8_t *tw, int w, int64_t b) {
  if (R16_K(type)) return tw + ((b / 8) * R16_K_BYTES(type) + R16_K_HEAD(type) + (b % 8) * R16_K_BLOCK(type)) * w;
  return tw + b * R16_BYTES(type) * w + R16_HALVES(type) * w;
}

/* Column c's d and minimum (0 without one) of block b in a tile tw of W rows, as the arithmetic takes them: Q4_K's
 * d * sc_j and -(dmin * m_j) (exact float32 products of a float16 and a 6-bit integer); Q6_K's d * sc of half h
 * (elements 16 h ..; exact too), the other layouts' the same for both halves. */
static inline void r16_scales(const int64_t type, const uint8_t *tw, int w, int64_t b, int h, int c, float *d,
                              float *m) {
  if (type == Q4_K_R16) {
    const uint8_t *ts = tw + (b / 8) * R16_K_BYTES(type) * w;
    const int j = (int)(b % 8), low = ts[4 * w + j * w + c];
    uint32_t hi;
    memcpy(&hi, ts + 12 * w + 4 * c, sizeof hi);
    const int sc = (low & 15) | (int)((hi >> (2 * j)) & 3) << 4, mn = (low >> 4) | (int)((hi >> (16 + 2 * j)) & 3) << 4;
    *d = f16(ts + 2 * c) * (float)sc;
    *m = -(f16(ts + 2 * w + 2 * c) * (float)mn);
    return;
  }
  if (type == Q6_K_R16) {
    const uint8_t *ts = tw + (b / 8) * R16_K_BYTES(type) * w;
    *d = f16(ts + 2 * c) * (float)(int8_t)ts[2 * w + (2 * (b % 8) + h) * w + c];
    *m = 0.0f;
    return;
  }
  const uint8_t *tb = tw + b * R16_BYTES(type) * w;
  *d = f16(tb + 2 * c);
  *m = type == Q4_1_R16 ? f16(tb + 2 * w + 2 * c) : 0.0f;
}

/* Bits at..at + n of a little-endian bit string (at % 8 + n <= 64), as the low bits of a word; reads no byte past
 * the last bit's. */
static inline uint64_t r16_bits(const uint8_t *p, int64_t at, int n) {
  uint64_t v = 0;
  memcpy(&v, p + at / 8, (size_t)((at % 8 + n + 7) / 8));
  v >>= at % 8;
  return n >= 64 ? v : v & ((1ull << n) - 1ull);
}

/* Element 4 g + e's u of row c in a block of W rows whose values start at v (the plain form of the layout). */
static inline int32_t r16_u(const int64_t type, const uint8_t *v, int w, int c, int g, int e) {
  if (type == Q8_0_R16) return v[(g * w + c) * 4 + e];
  const int32_t nib = (v[((g / 2) * w + c) * 4 + e] >> (4 * (g % 2))) & 15;
  if (type == Q6_K_R16) return nib | ((v[16 * w + ((g / 4) * w + c) * 4 + e] >> (2 * (g % 4))) & 3) << 4;
  if (type != Q5_0_R16) return nib;
  return nib | (int32_t)r16_bits(v + 16 * w, ((int64_t)g * w + c) * 4 + e, 1) << 4;
}

/* x's rows as the tiles read them, into out (out may be xq itself): signed q (the VNNI path's quantize_row writes
 * q + 128 for the other formats' products; here the weights are the unsigned operand). */
static void r16_signed_x(const int8_t *xq, int8_t *out, int64_t n) {
#if PATH == 2
  for (int64_t i = 0; i < n; i++) out[i] = (int8_t)((uint8_t)xq[i] ^ 0x80u);
#else
  if (out != xq) memcpy(out, xq, (size_t)n);
#endif
}

/* y[r, col + c] = v[c] for c < w, rows of y y_stride apart, float32 or rounded to bfloat16. */
INLINE void r16_store(const float *v, int w, void *y, int64_t index, int y_bf16) {
  for (int c = 0; c < w; c++) store_value(v[c], y, index + c, y_bf16);
}

#if PATH == 2
/* Groups g and g + 1 of a block of W rows (values at v, mask m of W lanes) as sixteen lanes of four u bytes each. */
INLINE void r16_pair(const int64_t type, const uint8_t *v, int w, __mmask16 m, int g, __m512i *v0, __m512i *v1) {
  if (type == Q8_0_R16) {
    *v0 = _mm512_maskz_loadu_epi32(m, v + g * 4 * w);
    *v1 = _mm512_maskz_loadu_epi32(m, v + (g + 1) * 4 * w);
    return;
  }
  const __m512i nib = _mm512_maskz_loadu_epi32(m, v + (g / 2) * 4 * w), low = _mm512_set1_epi8(15);
  *v0 = _mm512_and_si512(nib, low);
  *v1 = _mm512_and_si512(_mm512_srli_epi16(nib, 4), low);
  if (type == Q5_0_R16) { /* each group's 4 W fifth bits as a byte mask, then bit 4 of those bytes */
    const uint8_t *bits = v + 16 * w;
    const __m512i fifth = _mm512_set1_epi8(16);
    __mmask64 b0, b1;
    if (w == R16_TILE) { /* a whole tile: each group's bits are the 64-bit word 8 g bytes in */
      b0 = _load_mask64((const __mmask64 *)(bits + 8 * g)), b1 = _load_mask64((const __mmask64 *)(bits + 8 * g + 8));
    } else {
      b0 = (__mmask64)r16_bits(bits, (int64_t)g * 4 * w, 4 * w);
      b1 = (__mmask64)r16_bits(bits, (int64_t)(g + 1) * 4 * w, 4 * w);
    }
    *v0 = _mm512_or_si512(*v0, _mm512_maskz_mov_epi8(b0, fifth));
    *v1 = _mm512_or_si512(*v1, _mm512_maskz_mov_epi8(b1, fifth));
  }
  if (type == Q6_K_R16) { /* group 4 h + i's two bits at 2 i of the quad's bytes, moved to bits 4-5 (16-bit shifts:
                             what crosses into the next byte lands outside 0x30) */
    const __m512i hb = _mm512_maskz_loadu_epi32(m, v + 16 * w + (g / 4) * 4 * w), bits45 = _mm512_set1_epi8(0x30);
    const int i = g % 4; /* 0 or 2: this pair's groups are i and i + 1 of the quad */
    const __m512i h0 = i == 0 ? _mm512_slli_epi16(hb, 4) : hb, h1 = i == 0 ? _mm512_slli_epi16(hb, 2) : _mm512_srli_epi16(hb, 2);
    *v0 = _mm512_or_si512(*v0, _mm512_and_si512(h0, bits45));
    *v1 = _mm512_or_si512(*v1, _mm512_and_si512(h1, bits45));
  }
}

/* r16_scales for the W columns of block b (half h) at once (lanes past W zero). */
INLINE void r16_scales_v(const int64_t type, const uint8_t *tw, int w, __mmask16 m, int64_t b, int h, __m512 *d,
                         __m512 *mn) {
  if (type == Q4_K_R16) {
    const uint8_t *ts = tw + (b / 8) * R16_K_BYTES(type) * w;
    const int j = (int)(b % 8);
    const __m512i low = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, ts + 4 * w + j * w));
    const __m512i hi = _mm512_maskz_loadu_epi32(m, ts + 12 * w), three = _mm512_set1_epi32(3);
    const __m512i sc = _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi32(15)),
                                       _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hi, 2 * j), three), 4));
    const __m512i mi = _mm512_or_si512(_mm512_srli_epi32(low, 4),
                                       _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hi, 16 + 2 * j), three), 4));
    *d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, ts)), _mm512_cvtepi32_ps(sc));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, ts + 2 * w));
    const __m512i sign = _mm512_set1_epi32((int32_t)0x80000000u); /* negated, -0 for 0, as the plain path's minus */
    *mn = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mi))), sign));
    return;
  }
  if (type == Q6_K_R16) {
    const uint8_t *ts = tw + (b / 8) * R16_K_BYTES(type) * w;
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, ts + 2 * w + (2 * (b % 8) + h) * w));
    *d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, ts)), _mm512_cvtepi32_ps(sc));
    *mn = _mm512_setzero_ps();
    return;
  }
  const uint8_t *tb = tw + b * R16_BYTES(type) * w;
  *d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, tb));
  *mn = type == Q4_1_R16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, tb + 2 * w)) : _mm512_setzero_ps();
}

/* One tile of W <= 16 columns (tw its bytes) for rows r0 .. r0 + R of x (R a constant once inlined): per block,
 * each row's sixteen lane sums start at -z sum q and take eight vpdpbusd (the values by x's four bytes
 * broadcast), then one conversion and one fused multiply-add by d * dx (and a minimum's m * (dx * sum q)). */
INLINE void r16_tile(const int R, const int64_t type, const uint8_t *tw, int w, int64_t blocks, const int8_t *xq,
                     const float *xd, const int32_t *xs, int64_t k, int64_t r0, void *y, int64_t y_stride,
                     int64_t col, int y_bf16, int prefetch) {
  const __mmask16 m = (__mmask16)((1u << w) - 1u);
  /* a K layout's bytes per block on average: its super-blocks stream as one */
  const int64_t block_bytes = (R16_K(type) ? R16_K_BYTES(type) / 8 : R16_BYTES(type)) * (int64_t)w;
  __m512 acc[8];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t *tb = r16_values(type, tw, w, b);
    if (prefetch) prefetch_ahead(tw + b * block_bytes, block_bytes);
    if (type == Q6_K_R16) { /* per half: sixteen lanes of the sum of (q + 128)(u - 32), less 128 sum (u - 32) */
      const __m512i z = _mm512_set1_epi8(32), ones = _mm512_set1_epi8(1);
      for (int h = 0; h < 2; h++) {
        __m512i s[8], c = _mm512_setzero_si512();
        for (int r = 0; r < R; r++) s[r] = _mm512_setzero_si512();
        for (int g = 4 * h; g < 4 * h + 4; g += 2) {
          __m512i v0, v1;
          r16_pair(type, tb, w, m, g, &v0, &v1);
          v0 = _mm512_sub_epi8(v0, z), v1 = _mm512_sub_epi8(v1, z);
          c = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c, ones, v0), ones, v1);
          for (int r = 0; r < R; r++) {
            int32_t x0, x1;
            memcpy(&x0, xq + (r0 + r) * k + b * QK + 4 * g, sizeof x0);
            memcpy(&x1, xq + (r0 + r) * k + b * QK + 4 * g + 4, sizeof x1);
            s[r] = _mm512_dpbusd_epi32(s[r], _mm512_set1_epi32(x0), v0);
            s[r] = _mm512_dpbusd_epi32(s[r], _mm512_set1_epi32(x1), v1);
          }
        }
        __m512 d, none;
        r16_scales_v(type, tw, w, m, b, h, &d, &none);
        const __m512i bias = _mm512_slli_epi32(c, 7);
        for (int r = 0; r < R; r++) {
          const float dx = xd[(r0 + r) * (k / QK) + b];
          const __m512 l = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[r], bias));
          acc[r] = _mm512_fmadd_ps(l, _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r]);
        }
      }
      continue;
    }
    __m512i s[8];
    for (int r = 0; r < R; r++) s[r] = _mm512_set1_epi32(-R16_BIAS(type) * xs[(r0 + r) * (k / QK) + b]);
    for (int g = 0; g < 8; g += 2) {
      __m512i v0, v1;
      r16_pair(type, tb, w, m, g, &v0, &v1);
      for (int r = 0; r < R; r++) {
        int32_t x0, x1;
        memcpy(&x0, xq + (r0 + r) * k + b * QK + 4 * g, sizeof x0);
        memcpy(&x1, xq + (r0 + r) * k + b * QK + 4 * g + 4, sizeof x1);
        s[r] = _mm512_dpbusd_epi32(s[r], v0, _mm512_set1_epi32(x0));
        s[r] = _mm512_dpbusd_epi32(s[r], v1, _mm512_set1_epi32(x1));
      }
    }
    __m512 d, mn;
    r16_scales_v(type, tw, w, m, b, 0, &d, &mn);
    for (int r = 0; r < R; r++) {
      const int64_t xb = (r0 + r) * (k / QK) + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d, _mm512_set1_ps(xd[xb])), acc[r]);
      if (R16_MIN(type)) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xd[xb] * (float)xs[xb]), acc[r]);
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
static void r16_tile_row(const int64_t type, const uint8_t *tw, int w, int64_t blocks, const int8_t *xr,
                         const float *xdr, const int32_t *xsr, void *y, int64_t index, int y_bf16) {
  float acc[R16_TILE] = {0};
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t *v = r16_values(type, tw, w, b);
    for (int c = 0; c < w; c++) {
      if (type == Q6_K_R16) { /* each half of the block with its own scale */
        for (int h = 0; h < 2; h++) {
          int32_t l = 0;
          for (int g = 4 * h; g < 4 * h + 4; g++)
            for (int e = 0; e < 4; e++) l += (r16_u(type, v, w, c, g, e) - R16_BIAS(type)) * (int32_t)xr[b * QK + 4 * g + e];
          float d, none;
          r16_scales(type, tw, w, b, h, c, &d, &none);
          acc[c] = fmaf((float)l, d * xdr[b], acc[c]);
        }
        continue;
      }
      int32_t l = 0;
      for (int g = 0; g < 8; g++)
        for (int e = 0; e < 4; e++) l += (r16_u(type, v, w, c, g, e) - R16_BIAS(type)) * (int32_t)xr[b * QK + 4 * g + e];
      float d, m;
      r16_scales(type, tw, w, b, 0, c, &d, &m);
      acc[c] = fmaf((float)l, d * xdr[b], acc[c]);
      if (R16_MIN(type)) acc[c] = fmaf(m, xdr[b] * (float)xsr[b], acc[c]);
    }
  }
  r16_store(acc, w, y, index, y_bf16);
}
#endif

#if PATH == 1
/* The AVX2 form, for whole tiles (a short last tile takes the plain form: the same bits). Eight columns at a time
 * (half hh of the tile): a 256-bit register holds four u of each, x's four bytes broadcast; the exact integer sums
 * by vpmaddubsw (u by q in 16-bit pair sums) and vpmaddwd. Why: at one row the quad order spends ~60 operations on
 * four Q8_0 blocks of a column (unpacking, lane permutes, scales, a horizontal sum each column); here eight
 * columns' group of four elements is one load, x's broadcast and three to six operations (Q8_0: xor, abs, sign,
 * vpmaddubsw, vpmaddwd, add), and a block's scales one conversion for eight columns. */
#define R16_PASS_V 4 /* rows of x a pass: R int32 sums, R 16-bit sums and R float sums in sixteen registers */
#define R16_BOTH_ROWS 2 /* up to this many rows take both halves of a tile in one pass */

/* Group g (elements 4 g .. 4 g + 3) of columns 8 hh .. 8 hh + 7 of a whole tile's block whose values start at v:
 * the u bytes, four a column. */
INLINE __m256i r16_group_v(const int64_t type, const uint8_t *v, int g, int hh) {
  if (type == Q8_0_R16) return _mm256_loadu_si256((const __m256i *)(v + g * 64 + hh * 32));
  const __m256i nib = _mm256_loadu_si256((const __m256i *)(v + (g / 2) * 64 + hh * 32)), low = _mm256_set1_epi8(15);
  __m256i u = g % 2 ? _mm256_and_si256(_mm256_srli_epi16(nib, 4), low) : _mm256_and_si256(nib, low);
  if (type == Q5_0_R16) /* bit (16 g + c) 4 + e of the fifth bits: 32 bits a half, from byte 8 g + 4 hh */
    u = _mm256_or_si256(u, _mm256_and_si256(bit_bytes(u32le(v + 256 + 8 * g + 4 * hh)), _mm256_set1_epi8(16)));
  if (type == Q6_K_R16) { /* bits 2 i of the quad's bytes as bits 4, 5 (16-bit shifts: what crosses a byte lands
                             outside 0x30) */
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(v + 256 + (g / 4) * 64 + hh * 32));
    const int i = g % 4;
    const __m256i h = i == 0 ? _mm256_slli_epi16(hb, 4) : i == 1 ? _mm256_slli_epi16(hb, 2) : i == 2 ? hb : _mm256_srli_epi16(hb, 2);
    u = _mm256_or_si256(u, _mm256_and_si256(h, _mm256_set1_epi8(0x30)));
  }
  return u;
}

/* r16_scales of columns 8 hh .. 8 hh + 7 of a whole tile: d (Q6_K: of half h) and the minimum (0 without). */
INLINE void r16_scales8(const int64_t type, const uint8_t *tw, int64_t b, int h, int hh, __m256 *d, __m256 *mn) {
  const int w = R16_TILE;
  if (type == Q4_K_R16) {
    const uint8_t *ts = tw + (b / 8) * R16_K_BYTES(type) * w;
    const int j = (int)(b % 8);
    const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ts + 4 * w + j * w + 8 * hh)));
    const __m256i hi = _mm256_loadu_si256((const __m256i *)(ts + 12 * w + 32 * hh)), three = _mm256_set1_epi32(3);
    const __m256i sc = _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi32(15)),
                                       _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, 2 * j), three), 4));
    const __m256i mi = _mm256_or_si256(_mm256_srli_epi32(low, 4),
                                       _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, 16 + 2 * j), three), 4));
    *d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ts + 16 * hh))), _mm256_cvtepi32_ps(sc));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ts + 2 * w + 16 * hh)));
    *mn = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mi)), _mm256_set1_ps(-0.0f)); /* -(dmin m) */
    return;
  }
  if (type == Q6_K_R16) {
    const uint8_t *ts = tw + (b / 8) * R16_K_BYTES(type) * w;
    const __m128i sc = _mm_loadl_epi64((const __m128i *)(ts + 2 * w + (2 * (b % 8) + h) * w + 8 * hh));
    *d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ts + 16 * hh))),
                       _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    *mn = _mm256_setzero_ps();
    return;
  }
  const uint8_t *tb = tw + b * R16_BYTES(type) * w;
  *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tb + 16 * hh)));
  *mn = type == Q4_1_R16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tb + 2 * w + 16 * hh))) : _mm256_setzero_ps();
}

/* The sum of sixteen signed bytes. */
static inline int32_t r16_sum16(const int8_t *p) {
  const __m128i s = _mm_sad_epu8(_mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_set1_epi8((char)0x80)),
                                 _mm_setzero_si128());
  return _mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4) - 128 * 16;
}

/* Groups g0 .. g1 of columns 8 hh .. 8 hh + 8 NH of R rows into s[r * NH + h] (int32): u by q in 16-bit pair sums,
 * added in 16 bits over the groups (u <= 15: 8 groups, 8 * 2 * 15 * 127; u <= 31: 4; u <= 63: 2 fit), then one
 * vpmaddwd; Q8_0 (u - 128 up to 128 in size) as |w| by q with w's signs, each group's pair sums widened at once
 * (2 * 128 * 127 fits once). */
INLINE void r16_groups(const int R, const int NH, const int64_t type, const uint8_t *v, int g0, int g1, int hh,
                       const int8_t *const *xr, int64_t at, __m256i *s) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (type == Q8_0_R16) {
    for (int g = g0; g < g1; g++)
      for (int h = 0; h < NH; h++) {
        const __m256i wq = _mm256_xor_si256(r16_group_v(type, v, g, hh + h), _mm256_set1_epi8((char)0x80));
        const __m256i a = _mm256_abs_epi8(wq);
        for (int r = 0; r < R; r++) {
          int32_t x4;
          memcpy(&x4, xr[r] + at + 4 * g, sizeof x4);
          const __m256i p = _mm256_maddubs_epi16(a, _mm256_sign_epi8(_mm256_set1_epi32(x4), wq));
          s[r * NH + h] = _mm256_add_epi32(s[r * NH + h], _mm256_madd_epi16(p, ones));
        }
      }
    return;
  }
  const int run = R16_RUN(type);
  for (int g = g0; g < g1; g += run) {
    __m256i p[2 * FEW_ROWS];
    for (int i = 0; i < run && g + i < g1; i++)
      for (int h = 0; h < NH; h++) {
        const __m256i u = r16_group_v(type, v, g + i, hh + h);
        for (int r = 0; r < R; r++) {
          int32_t x4;
          memcpy(&x4, xr[r] + at + 4 * (g + i), sizeof x4);
          const __m256i t = _mm256_maddubs_epi16(u, _mm256_set1_epi32(x4));
          p[r * NH + h] = i == 0 ? t : _mm256_add_epi16(p[r * NH + h], t);
        }
      }
    for (int i = 0; i < R * NH; i++) s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(p[i], ones));
  }
}

/* Columns 8 hh .. 8 (hh + NH) of a whole tile tw for rows r0 .. r0 + R of x (R, NH constants once inlined): per
 * block (Q6_K: per half) each row's exact integer sums (from -z sum q), one conversion and one fused multiply-add
 * by d * dx, and a minimum's m * (dx * sum q): the plain form's float steps, eight columns a vector. */
INLINE void r16_tile8(const int R, const int NH, const int64_t type, const uint8_t *tw, int hh, int64_t blocks,
                      const int8_t *xq, const float *xd, const int32_t *xs, int64_t k, int64_t r0, void *y,
                      int64_t y_stride, int64_t col, int y_bf16, int prefetch) {
  const int64_t block_bytes = (R16_K(type) ? R16_K_BYTES(type) / 8 : R16_BYTES(type)) * (int64_t)R16_TILE;
  const int8_t *xr[FEW_ROWS]; /* R <= R16_PASS_V; FOR_PASS_ROWS instantiates up to FEW_ROWS */
  __m256 acc[2 * FEW_ROWS];
  for (int r = 0; r < R; r++) xr[r] = xq + (r0 + r) * k;
  for (int i = 0; i < R * NH; i++) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t *tb = r16_values(type, tw, R16_TILE, b);
    if (prefetch) prefetch_ahead(tw + b * block_bytes, block_bytes);
    const int halves = R16_HALF_SCALES(type) ? 2 : 1;
    for (int e = 0; e < halves; e++) { /* Q6_K's halves of the block, each with its own scales */
      __m256i s[2 * FEW_ROWS];
      for (int r = 0; r < R; r++) {
        const int64_t xb = (r0 + r) * (k / QK) + b;
        /* -z times the q's sum: the block's (xs), or Q6_K's half's; Q8_0's products are of u - z already */
        const int32_t qs = R16_HALF_SCALES(type) ? r16_sum16(xr[r] + b * QK + 16 * e) : xs[xb];
        for (int h = 0; h < NH; h++) s[r * NH + h] = _mm256_set1_epi32(type == Q8_0_R16 ? 0 : -R16_BIAS(type) * qs);
      }
      const int g0 = 8 / halves * e; /* the half's groups (Q6_K: four), else all eight */
      r16_groups(R, NH, type, tb, g0, g0 + 8 / halves, hh, xr, b * QK, s);
      for (int h = 0; h < NH; h++) {
        __m256 d, mn;
        r16_scales8(type, tw, b, e, hh + h, &d, &mn);
        for (int r = 0; r < R; r++) {
          const int64_t xb = (r0 + r) * (k / QK) + b;
          const int i = r * NH + h;
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(d, _mm256_set1_ps(xd[xb])), acc[i]);
          if (R16_MIN(type)) acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xd[xb] * (float)xs[xb]), acc[i]);
        }
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < NH; h++) {
      float v[8];
      _mm256_storeu_ps(v, acc[r * NH + h]);
      r16_store(v, 8, y, (r0 + r) * y_stride + col + 8 * (hh + h), y_bf16);
    }
}

/* Columns 8 hh .. 8 hh + 7 of a whole tile for rows r0 .. r0 + R of x (R <= FEW_ROWS, a constant once inlined),
 * the form for many rows: per block (Q6_K: per half) the half-tile's groups are unpacked once into uv (L1), then
 * each row in turn sums them against its broadcast bytes and folds the block into its float sum, so only the R
 * float sums stay in registers. Why: r16_tile8 keeps R 16-bit, R int32 and R float sums live over a block, more
 * than AVX2's sixteen registers hold (GCC's Q4_K code added 16-bit sums from the stack), unpacks each group once
 * per four rows, and Q6_K's half sums of q were summed again for every tile and pass. The same integer sums and
 * float steps as r16_tile8 (the same bits). hs: Q6_K's half sums of q, [row - hs_row0][block][2]
 * (r16_half_sums), else unused. */
INLINE void r16_tile8_many(const int R, const int64_t type, const uint8_t *tw, int hh, int64_t blocks,
                           const int8_t *xq, const float *xd, const int32_t *xs, const int32_t *hs, int64_t hs_row0,
                           int64_t k, int64_t r0, void *y, int64_t y_stride, int64_t col, int y_bf16, int prefetch) {
  const int64_t block_bytes = (R16_K(type) ? R16_K_BYTES(type) / 8 : R16_BYTES(type)) * (int64_t)R16_TILE;
  const int halves = R16_HALF_SCALES(type) ? 2 : 1, ng = 8 / halves;
  const int run = R16_RUN(type);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[FEW_ROWS];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t *tb = r16_values(type, tw, R16_TILE, b);
    if (prefetch) prefetch_ahead(tw + b * block_bytes, block_bytes);
    for (int e = 0; e < halves; e++) {
      const int g0 = ng * e;
      __m256i uv[8];
      for (int i = 0; i < ng; i++) uv[i] = r16_group_v(type, tb, g0 + i, hh);
      __m256 d, mn;
      r16_scales8(type, tw, b, e, hh, &d, &mn);
      for (int r = 0; r < R; r++) {
        const int8_t *xr = xq + (r0 + r) * k + b * QK + 4 * g0;
        const int64_t xb = (r0 + r) * (k / QK) + b;
        const int32_t qs = R16_HALF_SCALES(type) ? hs[((r0 + r - hs_row0) * blocks + b) * 2 + e] : xs[xb];
        __m256i s = _mm256_set1_epi32(-R16_BIAS(type) * qs);
        for (int i = 0; i < ng; i += run) {
          __m256i p = _mm256_setzero_si256();
          for (int j = i; j < i + run; j++) {
            int32_t x4;
            memcpy(&x4, xr + 4 * j, sizeof x4);
            const __m256i t = _mm256_maddubs_epi16(uv[j], _mm256_set1_epi32(x4));
            p = j == i ? t : _mm256_add_epi16(p, t);
          }
          s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(xd[xb])), acc[r]);
        if (R16_MIN(type)) acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xd[xb] * (float)xs[xb]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    float v[8];
    _mm256_storeu_ps(v, acc[r]);
    r16_store(v, 8, y, (r0 + r) * y_stride + col + 8 * hh, y_bf16);
  }
}

/* Q6_K's sums of q over each 16-element half of each block, for rows r0 .. r1 of x: hs[r - r0][block][2]. */
static void r16_half_sums(const int8_t *xq, int64_t k, int64_t r0, int64_t r1, int32_t *hs) {
  for (int64_t r = r0; r < r1; r++)
    for (int64_t h = 0; h < k / 16; h++) hs[(r - r0) * (k / 16) + h] = r16_sum16(xq + r * k + 16 * h);
}
#endif

/* Columns j0..j1 of y (j0 a multiple of 16; j1 one too, or the last column) for every row of x: tile by tile, the
 * rows in passes of up to eight (their sums in registers) while the tile's bytes stay in L1. */
INLINE void r16_columns(const int64_t type, const uint8_t *weight, int64_t j0, int64_t j1, int64_t k,
                        const int8_t *xq, const float *xd, const int32_t *xs, int64_t rows, void *y,
                        int64_t y_stride, int y_bf16) {
  const int64_t blocks = k / QK, row_bytes = R16_ROW_BYTES(type, k);
#if PATH >= 1
  prefetch_start(weight + j0 * row_bytes);
#endif
  /* Many rows (a prompt) in blocks whose x stays in L2 while the chunk's tiles (in L1) pass over it. */
  const int64_t fit = R16_ROW_BLOCK_BYTES / k / R16_PASS * R16_PASS, block_rows = fit > R16_PASS ? fit : R16_PASS;
#if PATH == 1
  /* Q6_K's half sums of q for a block of rows, once (not per tile and pass); NULL: one or two rows, or no memory
   * (then those rows take the plain form) */
  int32_t *hs = NULL;
  if (type == Q6_K_R16 && rows > R16_BOTH_ROWS) hs = malloc(sizeof(int32_t) * (size_t)(block_rows * k / 16));
#endif
  for (int64_t rb = 0; rb < rows; rb += block_rows) {
    const int64_t rend = rows - rb < block_rows ? rows : rb + block_rows;
#if PATH == 1
    if (hs) r16_half_sums(xq, k, rb, rend, hs);
#endif
    for (int64_t j = j0; j < j1; j += R16_TILE) {
      const int w = (int)(j1 - j < R16_TILE ? j1 - j : R16_TILE);
      const uint8_t *tw = weight + j * row_bytes;
#if PATH == 2
      for (int64_t r0 = rb; r0 < rend; r0 += FEW_ROWS) {
#define R16(R) r16_tile(R, type, tw, w, blocks, xq, xd, xs, k, r0, y, y_stride, j, y_bf16, r0 == 0)
        FOR_PASS_ROWS(rend, r0, FEW_ROWS, R16)
#undef R16
      }
#else
#if PATH == 1
      if (w == R16_TILE) {
        if (rend - rb <= R16_BOTH_ROWS) { /* a few rows: both halves of the tile in one pass over its bytes */
#define R16(R) r16_tile8(R, 2, type, tw, 0, blocks, xq, xd, xs, k, rb, y, y_stride, j, y_bf16, rb == 0)
          FOR_PASS_ROWS(rend, rb, R16_BOTH_ROWS, R16)
#undef R16
          continue;
        }
        /* more rows: Q6_K (its half sums at hand) and, from five rows, Q4_1, Q5_0 and Q4_K in passes of eight with
         * the groups unpacked once (r16_tile8_many); Q8_0, whose two operands a group would both go through
         * memory there (5-14% slower), and four rows or fewer in passes of four with them in registers */
        if (type == Q6_K_R16 ? hs != NULL : type != Q8_0_R16 && rend - rb > R16_PASS_V) {
          for (int hh = 0; hh < 2; hh++)
            for (int64_t r0 = rb; r0 < rend; r0 += FEW_ROWS) {
#define R16(R)                                                                                                      \
  r16_tile8_many(R, type, tw, hh, blocks, xq, xd, xs, hs, rb, k, r0, y, y_stride, j, y_bf16, r0 == 0 && hh == 0)
              FOR_PASS_ROWS(rend, r0, FEW_ROWS, R16)
#undef R16
            }
          continue;
        }
        if (type != Q6_K_R16) { /* Q6_K without its half sums (no memory) takes the plain form below */
          for (int hh = 0; hh < 2; hh++)
            for (int64_t r0 = rb; r0 < rend; r0 += R16_PASS_V) {
#define R16(R) r16_tile8(R, 1, type, tw, hh, blocks, xq, xd, xs, k, r0, y, y_stride, j, y_bf16, r0 == 0 && hh == 0)
              FOR_PASS_ROWS(rend, r0, R16_PASS_V, R16)
#undef R16
            }
          continue;
        }
      }
#endif
      for (int64_t r = rb; r < rend; r++)
        r16_tile_row(type, tw, w, blocks, xq + r * k, xd + r * blocks, xs + r * blocks, y, r * y_stride + j, y_bf16);
#endif
    }
  }
#if PATH == 1
  free(hs);
#endif
}

#define R16_COLUMNS_FOR(T)                                                                                      \
  static void columns_##T(const uint8_t *w, int64_t j0, int64_t j1, int64_t k, const int8_t *xq, const float *xd, \
                          const int32_t *xs, const xquad *xg, int64_t rows, void *y, int64_t y_stride,          \
                          int y_bf16) {                                                                          \
    (void)xg;                                                                                                    \
    r16_columns(T, w, j0, j1, k, xq, xd, xs, rows, y, y_stride, y_bf16);                                        \
  }
R16_COLUMNS_FOR(Q8_0_R16)
R16_COLUMNS_FOR(Q4_1_R16)
R16_COLUMNS_FOR(Q5_0_R16)
R16_COLUMNS_FOR(Q4_K_R16)
R16_COLUMNS_FOR(Q6_K_R16)

#if PATH == 2
/* One block of a tile of W columns into rows of dst (column c's elements at index at + c * k ..): the eight groups'
 * u bytes (sixteen columns' four elements each) turned into each column's 32 u in element order, then per column
 * two vectors of sixteen widened, less z, times the column's d (Q6_K: each half's), plus its minimum: the plain
 * loop's operations on sixteen lanes, one contiguous store a column (the scattered four-element stores of a
 * lanes-as-columns form ran 4-10x slower than the row-major formats' dequantization). */
INLINE void r16_dequantize_block(const int64_t type, const uint8_t *tw, int w, int64_t b, void *dst, int64_t at,
                                 int64_t k, int bf16) {
  const __mmask16 m = (__mmask16)((1u << w) - 1u);
  const uint8_t *tb = r16_values(type, tw, w, b);
  __m512 dv, mv;
  r16_scales_v(type, tw, w, m, b, 0, &dv, &mv);
  float d[2][R16_TILE], mn[R16_TILE];
  _mm512_storeu_ps(d[0], dv);
  _mm512_storeu_ps(mn, mv);
  if (R16_HALF_SCALES(type)) r16_scales_v(type, tw, w, m, b, 1, &dv, &mv);
  _mm512_storeu_ps(d[1], dv);
  uint32_t groups[8][R16_TILE], cols[R16_TILE][8]; /* [group][column] four u bytes, then [column][group] */
  for (int g = 0; g < 8; g += 2) {
    __m512i v0, v1;
    r16_pair(type, tb, w, m, g, &v0, &v1);
    _mm512_storeu_si512(groups[g], v0);
    _mm512_storeu_si512(groups[g + 1], v1);
  }
  for (int c = 0; c < w; c++)
    for (int g = 0; g < 8; g++) cols[c][g] = groups[g][c];
  const __m512i z = _mm512_set1_epi32(R16_BIAS(type));
  for (int c = 0; c < w; c++) {
    __m512 val[2];
    for (int h = 0; h < 2; h++) {
      const __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)cols[c] + h)), z);
      val[h] = _mm512_mul_ps(_mm512_set1_ps(d[h][c]), _mm512_cvtepi32_ps(q));
      if (R16_MIN(type)) val[h] = _mm512_add_ps(val[h], _mm512_set1_ps(mn[c]));
    }
    const int64_t to = at + c * k;
    if (!bf16) {
      _mm512_storeu_ps((float *)dst + to, val[0]);
      _mm512_storeu_ps((float *)dst + to + 16, val[1]);
      continue;
    }
#ifdef __AVX512BF16__
    /* the instruction's rounding is torch's here: a nonzero value is a multiple of 2^-24, never subnormal */
    _mm512_storeu_si512((uint16_t *)dst + to, (__m512i)_mm512_cvtne2ps_pbh(val[1], val[0]));
#else
    float f[32];
    _mm512_storeu_ps(f, val[0]);
    _mm512_storeu_ps(f + 16, val[1]);
    for (int e = 0; e < 32; e++) store_value(f[e], dst, to + e, 1);
#endif
  }
}
#endif

#if PATH == 1
/* One block of a whole tile into rows of dst (column c's elements at index at + c * k ..), as the VNNI path's
 * r16_dequantize_block: the groups' u bytes (eight columns' four a register) turned into each column's 32 u in
 * element order, then eight at a time widened, less z, times the column's d (Q6_K: each half's), plus its minimum:
 * the plain loop's operations (a prompt's tiled path dequantizes a repacked weight whole: 0.6 s of a 512-token
 * Gemma 3 prefill spent in the plain loop). */
INLINE void r16_dequantize_block8(const int64_t type, const uint8_t *tw, int64_t b, void *dst, int64_t at, int64_t k,
                                  int bf16) {
  const uint8_t *tb = r16_values(type, tw, R16_TILE, b);
  float d[2][R16_TILE], mn[R16_TILE];
  uint32_t groups[8][R16_TILE], cols[R16_TILE][8]; /* [group][column] four u bytes, then [column][group] */
  for (int hh = 0; hh < 2; hh++) {
    __m256 dv, mv;
    r16_scales8(type, tw, b, 0, hh, &dv, &mv);
    _mm256_storeu_ps(d[0] + 8 * hh, dv);
    _mm256_storeu_ps(mn + 8 * hh, mv);
    if (R16_HALF_SCALES(type)) r16_scales8(type, tw, b, 1, hh, &dv, &mv);
    _mm256_storeu_ps(d[1] + 8 * hh, dv);
    for (int g = 0; g < 8; g++) _mm256_storeu_si256((__m256i *)(groups[g] + 8 * hh), r16_group_v(type, tb, g, hh));
  }
  for (int c = 0; c < R16_TILE; c++)
    for (int g = 0; g < 8; g++) cols[c][g] = groups[g][c];
  const __m256i z = _mm256_set1_epi32(R16_BIAS(type));
  for (int c = 0; c < R16_TILE; c++) {
    float f[32];
    for (int i = 0; i < 4; i++) { /* elements 8 i .. 8 i + 7: half i / 2 */
      const __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)cols[c] + 8 * i))), z);
      __m256 v = _mm256_mul_ps(_mm256_set1_ps(d[i / 2][c]), _mm256_cvtepi32_ps(q));
      if (R16_MIN(type)) v = _mm256_add_ps(v, _mm256_set1_ps(mn[c]));
      _mm256_storeu_ps(f + 8 * i, v);
    }
    const int64_t to = at + c * k;
    if (bf16)
      for (int e = 0; e < 32; e++) store_value(f[e], dst, to + e, 1);
    else
      memcpy((float *)dst + to, f, sizeof f);
  }
}
#endif

/* Column c (0..w-1) of the tile tw (w columns) into dst + at: its k values, as the plain loop of
 * pagoda_quant_dequantize_r16 writes them (d (u - z) (+ m) per element, bit for bit on every path). */
static void r16_dequantize_column(const int64_t type, const uint8_t *tw, int w, int c, int64_t k, void *dst,
                                  int64_t at, int bf16) {
  for (int64_t b = 0; b < k / QK; b++) {
    const uint8_t *tb = r16_values(type, tw, w, b);
    float d[2], m;
    r16_scales(type, tw, w, b, 0, c, &d[0], &m);
    d[1] = d[0];
    if (R16_HALF_SCALES(type)) r16_scales(type, tw, w, b, 1, c, &d[1], &m);
    for (int g = 0; g < 8; g++)
      for (int e = 0; e < 4; e++) {
        float v = d[g / 4] * (float)(r16_u(type, tb, w, c, g, e) - R16_BIAS(type));
        if (R16_MIN(type)) v = v + m;
        store_value(v, dst, at + b * QK + 4 * g + e, bf16);
      }
  }
}

/* Rows ids[0..m) of a repacked weight [n, k] into dst ([m, k] float32, or rounded to bfloat16): an embedding
 * lookup, each row its column of its tile, read alone (a one-token step reads 1 row, not a tile or a gathered
 * copy). 0 on success, 1 for a type that is not a repacked layout or an id outside 0..n-1 (nothing written). */
int pagoda_quant_take_r16(int64_t type, const uint8_t *weight, int64_t n, int64_t k, const int64_t *ids, int64_t m,
                          void *dst, int64_t bf16) {
  if (!R16_TYPE(type) || k % (R16_K(type) ? QK_K : QK)) return 1;
  for (int64_t i = 0; i < m; i++)
    if (ids[i] < 0 || ids[i] >= n) return 1;
  const int64_t row_bytes = R16_ROW_BYTES(type, k);
  for (int64_t i = 0; i < m; i++) {
    const int64_t j = ids[i] - ids[i] % R16_TILE;
    const int w = (int)(n - j < R16_TILE ? n - j : R16_TILE);
    r16_dequantize_column(type, weight + j * row_bytes, w, (int)(ids[i] - j), k, dst, i * k, (int)bf16);
  }
  return 0;
}

/* Rows r0..r1 of a repacked weight [n, k] (r0 a multiple of 16; r1 too, or n) into dst as float32 rows, or rounded
 * to bfloat16 (bf16): the values d (u - z) (+ m) its source format's dequantization gives, bit for bit (the library
 * fuses no multiply-add). 0 on success, 1 for a type that is not a repacked layout or rows off the tiles. */
int pagoda_quant_dequantize_r16(int64_t type, const uint8_t *weight, int64_t n, int64_t k, int64_t r0, int64_t r1,
                                void *dst, int64_t bf16, int64_t num_threads) {
  if (!R16_TYPE(type) || k % (R16_K(type) ? QK_K : QK) || r0 % R16_TILE || r0 < 0 || r1 > n || (r1 % R16_TILE && r1 != n)) return 1;
  const int64_t row_bytes = R16_ROW_BYTES(type, k), tiles = (r1 - r0 + R16_TILE - 1) / R16_TILE;
  if (num_threads < 1 || tiles < 4) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t t = 0; t < tiles; t++) {
    const int64_t j = r0 + t * R16_TILE;
    const int w = (int)(r1 - j < R16_TILE ? r1 - j : R16_TILE);
    const uint8_t *tw = weight + j * row_bytes;
#if PATH == 2
    for (int64_t b = 0; b < k / QK; b++) r16_dequantize_block(type, tw, w, b, dst, (j - r0) * k + b * QK, k, (int)bf16);
#else
#if PATH == 1
    if (w == R16_TILE) {
      for (int64_t b = 0; b < k / QK; b++) r16_dequantize_block8(type, tw, b, dst, (j - r0) * k + b * QK, k, (int)bf16);
      continue;
    }
#endif
    for (int c = 0; c < w; c++) r16_dequantize_column(type, tw, w, c, k, dst, (j - r0 + c) * k, (int)bf16);
#endif
  }
  return 0;
}
