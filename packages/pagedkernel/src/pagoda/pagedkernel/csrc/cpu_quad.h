/* The quad order: Q4_1, Q5_0, Q8_0, Q4_K and Q6_K weights times int8 rows of x, four 32-element blocks (128
 * elements) at a time (included by cpu_quant.c).
 *
 * Why: at one row a Q4_1 GEMV is bound by the instructions per 32-element block, not by memory. The per-block form
 * (block32 + one_row_step) spends ~22 instructions on 20 bytes: two scalar half conversions, a broadcast, the
 * minimum's scalar product, and eight float lanes per block. Measured on a 2-core AMD EPYC Zen 4, the default
 * model's 30 layers of Q4_1 GEMVs (66 MB) took 3.0 ms with the weights in cache and 3.3 ms from DRAM (a plain
 * read of the same bytes: 1.8 ms). Four blocks at a time: one byte permute gathers their 64 bytes of nibbles, one
 * word permute their scales and minima (one half-to-float conversion for eight), and each float lane sums eight
 * products of a block (its quarter of elements 0..15 and the same quarter of 16..31) instead of four: 1.3 ms in
 * cache, 2.1 ms from DRAM. Q5_0, Q8_0, Q4_K and Q6_K (Gemma 3's layers and LM head) take the same order: there the
 * per-block form spent about seven vector operations per block and row (a 16-row step's 262,144-row Q8_0 head
 * 24 ms, ten times one row's; Q4_K and Q6_K unpacked each super-block to memory first), where four blocks share
 * them here (the head at 16 rows 12 ms; pagedkernel README, cpu backend).
 *
 * The arithmetic, the same on every path (AVX-512 with VNNI, AVX2 with or without VNNI, plain C), so that every
 * path and any number of rows give bitwise the same y (tested):
 *   - blocks are taken in groups of four (the last group may be short: its missing blocks add nothing);
 *   - each weight is read as an unsigned byte u = w + c (Q4_1: the nibble, c = 0; Q5_0: the 5-bit value, c = 16;
 *     Q8_0: the signed byte + 128, c = 128); Q4_K's 32-element sub-blocks are its blocks (u the nibble, d the
 *     super-block's d times the sub-block's 6-bit scale, m minus dmin times its 6-bit minimum, each one float
 *     product), four of them (half a super-block) a group;
 *   - lane 4 jj + l (jj the block in its group, l = 0..3) of 16 float lanes: acc = fma((float)L, d * dx, acc),
 *     one fused multiply-add (the library fuses nothing else: written out; 4-6% faster from two rows than a
 *     multiply and an add), L the exact integer sum of w q over elements 4l..4l+3 and 16+4l..16+4l+3 of block jj
 *     (sum u q - c sum q), d its scale, dx x's;
 *   - the minimum per block (Q4_1, Q4_K): o[jj] += m * (dx * (float)qsum), qsum the sum of x's q over the block;
 *     (in the vectors d, m of a group are the words [d0, m0, .., d3, m3], m = 0 for the formats without one, and
 *     x's factors [dx0, dx0 qsum0, ..]: one multiply gives both products of all four blocks);
 *   - y = tree(acc) (+ tree(o) with minima): acc[i] + acc[i + 8], then + [i + 4], + [i + 2], + [i + 1]; o[0] + o[2]
 *     and o[1] + o[3], then their sum (the additions a vector reduction makes, written out for the plain path).
 * Q6_K (scales per 16 elements, values u = q6 of 0..63, c = 32) keeps a block's halves apart: lane 4 jj + l of one
 * sum (lo) takes elements 4l..4l+3 of block jj with the scale of elements 0..15, of another (hi) elements
 * 16+4l..16+4l+3 with the scale of 16..31; each lane four products, -32 times their q's sum, times (d sc) * dx (d sc
 * one float product, as dequantization rounds it); y = tree(lo + hi, lane by lane). That costs twice the float steps
 * of the others per block, still a quarter of the per-block form's.
 */

#define QUAD_TYPE(t) ((t) == Q4_1 || (t) == Q5_0 || (t) == Q8_0 || (t) == Q4_K || (t) == Q6_K)
/* Bytes per 32 elements: Q4_1 half d, half m, 16 bytes of nibbles; Q5_0 half d, 4 bytes of fifth bits, 16 of
 * nibbles; Q8_0 half d, 32 signed bytes; Q4_K an eighth of its 144-byte super-block (its groups are its halves;
 * Q6_K's too, found from the super-block's 210 bytes). */
#define QUAD_BLOCK_BYTES(t) ((t) == Q4_1 ? 20 : (t) == Q5_0 ? 22 : (t) == Q8_0 ? 34 : 18)
/* c: what the unsigned form of a weight adds to its value. */
#define QUAD_BIAS(t) ((t) == Q8_0 ? 128 : (t) == Q5_0 ? 16 : 0)
#define QUAD_MIN(t) ((t) == Q4_1 || (t) == Q4_K)
/* Q6_K's scales are per 16 elements: its lanes do not join a block's halves (below). */
#define QUAD_SPLIT(t) ((t) == Q6_K)

/* One group of four blocks of a row of x in the form every path reads: q (signed) of each block's elements 0..15
 * and 16..31, four blocks side by side, each block's dx and dx * qsum (interleaved), and each lane's -16 and -128
 * times the sum of its eight q (the c sum q of the formats whose weights are read as w + c). A format's steps touch
 * only the cache lines of the fields they read. */
typedef struct {
  int8_t lo[64], hi[64];
  int32_t b16[16], b128[16];
  int32_t b32lo[16], b32hi[16]; /* Q6_K's: -32 times the sum of each lane's four q of lo, and of hi */
  float dx[16];                 /* each lane's block's dx */
  float s[8];
} __attribute__((aligned(64))) xquad;

/* Row r0 of y (y_stride values a row, bfloat16 or float32 values). */
static inline void *y_row(void *y, int64_t r0, int64_t y_stride, int y_bf16) {
  return (char *)y + (size_t)(r0 * y_stride) * (y_bf16 ? sizeof(uint16_t) : sizeof(float));
}

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
#if PATH >= 1
      /* each lane's four q summed in vectors (ones by q in pair sums, then pairs of those: exact), the same ints */
      const __m128i ones8 = _mm_set1_epi8(1), ones16 = _mm_set1_epi16(1), zero = _mm_setzero_si128();
      const __m128i lo = _mm_madd_epi16(_mm_maddubs_epi16(ones8, _mm_loadu_si128((const __m128i *)(x->lo + 16 * jj))), ones16);
      const __m128i hi = _mm_madd_epi16(_mm_maddubs_epi16(ones8, _mm_loadu_si128((const __m128i *)(x->hi + 16 * jj))), ones16);
      const __m128i both = _mm_add_epi32(lo, hi);
      _mm_storeu_si128((__m128i *)(x->b16 + 4 * jj), _mm_sub_epi32(zero, _mm_slli_epi32(both, 4)));
      _mm_storeu_si128((__m128i *)(x->b128 + 4 * jj), _mm_sub_epi32(zero, _mm_slli_epi32(both, 7)));
      _mm_storeu_si128((__m128i *)(x->b32lo + 4 * jj), _mm_sub_epi32(zero, _mm_slli_epi32(lo, 5)));
      _mm_storeu_si128((__m128i *)(x->b32hi + 4 * jj), _mm_sub_epi32(zero, _mm_slli_epi32(hi, 5)));
      _mm_storeu_ps(x->dx + 4 * jj, _mm_set1_ps(xd[b]));
#else
      for (int l = 0; l < 4; l++) {
        int32_t lo = 0, hi = 0;
        for (int e = 4 * l; e < 4 * l + 4; e++) lo += x->lo[16 * jj + e], hi += x->hi[16 * jj + e];
        x->b16[4 * jj + l] = -16 * (lo + hi);
        x->b128[4 * jj + l] = -128 * (lo + hi);
        x->b32lo[4 * jj + l] = -32 * lo;
        x->b32hi[4 * jj + l] = -32 * hi;
        x->dx[4 * jj + l] = xd[b];
      }
#endif
      x->s[2 * jj] = xd[b];
      x->s[2 * jj + 1] = xd[b] * (float)xs[b];
    }
  }
}

/* Q4_K: the scales [d sc, -(dmin mn)] of half h's four sub-blocks of the super-block at sb. */
static inline void k4_scales(const uint8_t *sb, int64_t h, float dm[8]) {
  uint8_t sc[8], mn[8];
  k_scales(sb + 4, sc, mn);
  const float d = f16(sb), dmin = f16(sb + 2);
  for (int jj = 0; jj < 4; jj++) {
    dm[2 * jj] = d * (float)sc[4 * h + jj];
    dm[2 * jj + 1] = -(dmin * (float)mn[4 * h + jj]);
  }
}

/* Block b of the row at w as the quad order reads it: u = w + c of elements 0..31, its scale d and minimum m (0
 * for the formats without one). */
static inline void quad_block(const int64_t type, const uint8_t *w, int64_t b, uint8_t u[32], float *d, float *m) {
  if (type == Q6_K) { /* q6_values' sub-block b % 8 unsigned; d the scale of its elements 0..15, m of 16..31 */
    const uint8_t *sb = w + b / 8 * 210;
    const int64_t h = b % 8 / 4, j = b % 4;
    const uint8_t *ql = sb + 64 * h + 32 * (j % 2), *qh = sb + 128 + 32 * h;
    for (int e = 0; e < 32; e++)
      u[e] = (uint8_t)(((ql[e] >> (4 * (j / 2))) & 0x0F) | (((qh[e] >> (2 * j)) & 3) << 4));
    const float dd = f16(sb + 208);
    *d = dd * (float)(int8_t)sb[192 + 2 * (b % 8)], *m = dd * (float)(int8_t)sb[192 + 2 * (b % 8) + 1];
    return;
  }
  if (type == Q4_K) {
    const uint8_t *sb = w + b / 8 * 144, *qs = sb + 16 + 32 * (b % 8 / 2);
    const int shift = (int)(b % 2) * 4;
    float dm[8];
    k4_scales(sb, b % 8 / 4, dm);
    *d = dm[2 * (b % 4)], *m = dm[2 * (b % 4) + 1];
    for (int e = 0; e < 32; e++) u[e] = (uint8_t)((qs[e] >> shift) & 0x0F);
    return;
  }
  const uint8_t *blk = w + b * QUAD_BLOCK_BYTES(type);
  *d = f16(blk);
  *m = type == Q4_1 ? f16(blk + 2) : 0.0f;
  if (type == Q8_0) {
    for (int e = 0; e < 32; e++) u[e] = (uint8_t)(blk[2 + e] ^ 0x80);
    return;
  }
  const uint8_t *qs = blk + (type == Q4_1 ? 4 : 6);
  const uint32_t h = type == Q5_0 ? u32le(blk + 2) : 0;
  for (int e = 0; e < 16; e++) {
    u[e] = (uint8_t)((qs[e] & 0x0F) | (((h >> e) & 1u) << 4));
    u[e + 16] = (uint8_t)((qs[e] >> 4) | (((h >> (e + 16)) & 1u) << 4));
  }
}

/* tree(acc) + tree(o) (tree(acc) alone without minima), as the header says. */
static inline float quad_reduce(const float acc[16], const float o[4], int has_min) {
  float t8[8], t4[4], t2[2];
  for (int i = 0; i < 8; i++) t8[i] = acc[i] + acc[i + 8];
  for (int i = 0; i < 4; i++) t4[i] = t8[i] + t8[i + 4];
  for (int i = 0; i < 2; i++) t2[i] = t4[i] + t4[i + 2];
  if (!has_min) return t2[0] + t2[1];
  const float u0 = o[0] + o[2], u1 = o[1] + o[3];
  return (t2[0] + t2[1]) + (u0 + u1);
}

/* One column of one row in plain C: the specification the vector paths follow. */
static float quad_dot(const int64_t type, const uint8_t *w, int64_t blocks, const xquad *g) {
  float acc[16] = {0}, hi[16] = {0}, o[4] = {0};
  const int32_t c = QUAD_BIAS(type);
  for (int64_t b = 0; b < blocks; b++) {
    const xquad *x = g + b / 4;
    const int jj = (int)(b % 4);
    uint8_t u[32];
    float d, m; /* Q6_K: the scales of the block's two halves */
    quad_block(type, w, b, u, &d, &m);
    const float s = d * x->s[2 * jj];
    for (int l = 0; l < 4; l++) {
      const int i = 4 * jj + l;
      int32_t lo_sum = 0, hi_sum = 0;
      for (int e = 4 * l; e < 4 * l + 4; e++)
        lo_sum += (int32_t)u[e] * x->lo[16 * jj + e], hi_sum += (int32_t)u[e + 16] * x->hi[16 * jj + e];
      if (QUAD_SPLIT(type)) {
        acc[i] = fmaf((float)(x->b32lo[i] + lo_sum), s, acc[i]);
        hi[i] = fmaf((float)(x->b32hi[i] + hi_sum), m * x->s[2 * jj], hi[i]);
      } else {
        const int32_t bias = c == 128 ? x->b128[i] : c == 16 ? x->b16[i] : 0;
        acc[i] = fmaf((float)(bias + lo_sum + hi_sum), s, acc[i]);
      }
    }
    if (QUAD_MIN(type)) o[jj] = o[jj] + m * x->s[2 * jj + 1];
  }
  if (QUAD_SPLIT(type))
    for (int i = 0; i < 16; i++) acc[i] = acc[i] + hi[i];
  return quad_reduce(acc, o, QUAD_MIN(type));
}

#if PATH >= 1
/* The sum the plain path's quad_reduce makes, of 16 lanes as two halves (lanes 0..7, 8..15) and, with minima,
 * their terms in the odd lanes of o ([., o0, ., o1, ., o2, ., o3]). */
INLINE float quad_reduce_v(__m256 lo, __m256 hi, __m256 o, int has_min) {
  const __m256 t8 = _mm256_add_ps(lo, hi);
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  const __m128 t1 = _mm_add_ss(t2, _mm_movehdup_ps(t2));
  if (!has_min) return _mm_cvtss_f32(t1);
  const __m128 u4 = _mm_add_ps(_mm256_castps256_ps128(o), _mm256_extractf128_ps(o, 1)); /* lanes 1, 3: o0+o2, o1+o3 */
  const __m128 u2 = _mm_shuffle_ps(u4, u4, _MM_SHUFFLE(3, 3, 3, 1));
  const __m128 u1 = _mm_add_ss(u2, _mm_movehdup_ps(u2));
  return _mm_cvtss_f32(_mm_add_ss(t1, u1));
}

/* A Q5_0 or Q8_0 block's u bytes in a register: [elements 0..15 | 16..31]. */
INLINE __m256i quad_block_v(const int64_t type, const uint8_t *blk) {
  if (type == Q8_0) return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), _mm256_set1_epi8((char)0x80));
  return fives_v(blk + 2, blk + 6);
}

/* Group gi's scales as a vector of four pairs [d, m] (m = 0 without a minimum) from the row at w; missing blocks
 * 0. */
INLINE __m256 quad_scales(const int64_t type, const uint8_t *row, int64_t gi, int have) {
  if (type == Q6_K) { /* [d sc of elements 0..15, of 16..31] of each block: the stored order of the scales */
    const uint8_t *sb = row + gi / 2 * 210;
    const __m256 d = _mm256_set1_ps(f16(sb + 208));
    const __m128i sc = _mm_loadl_epi64((const __m128i *)(sb + 192 + 8 * (gi % 2)));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
  }
  if (type == Q4_K) { /* k4_scales in vectors: the same bytes, and each float the same one product */
    const uint8_t *sb = row + gi / 2 * 144;
    const __m128i sc = _mm_loadu_si128((const __m128i *)(sb + 4)); /* 12 scale bytes (and 4 of qs) */
    __m128i v;
    if (gi % 2 == 0) { /* [sc0, mn0, .., sc3, mn3]: bytes 0..3 and 4..7, six bits each */
      v = _mm_and_si128(_mm_shuffle_epi8(sc, _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 0, 0, 0, 0, 0, 0, 0, 0)),
                        _mm_set1_epi8(0x3F));
    } else { /* low four bits from bytes 8..11 (sc the low nibble, mn the high), top two from bytes 0..7's bits 6-7 */
      const __m128i a = _mm_shuffle_epi8(sc, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 0, 0, 0, 0, 0, 0, 0, 0));
      const __m128i b = _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 0, 0, 0, 0, 0, 0, 0, 0));
      const __m128i m4 = _mm_set1_epi8(0x0F), odd = _mm_set1_epi16((short)0xFF00);
      const __m128i low = _mm_blendv_epi8(_mm_and_si128(a, m4), _mm_and_si128(_mm_srli_epi16(a, 4), m4), odd);
      v = _mm_or_si128(low, _mm_and_si128(_mm_srli_epi16(b, 2), _mm_set1_epi8(0x30)));
    }
    /* [d, -dmin] four times: -(dmin * mn) is (-dmin) * mn exactly */
    const __m128 dd = _mm_xor_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)u32le(sb))), _mm_setr_ps(0.0f, -0.0f, 0.0f, 0.0f));
    const __m256 d4 = _mm256_castpd_ps(_mm256_broadcastsd_pd(_mm_castps_pd(dd)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), d4);
  }
  const uint8_t *w = row + gi * 4 * QUAD_BLOCK_BYTES(type);
  if (type != Q4_1 && have == 4) { /* four halves, each in the low word of a 32-bit lane: two 64-bit inserts */
    const int64_t s = QUAD_BLOCK_BYTES(type);
    const uint64_t a = (uint64_t)(w[0] | w[1] << 8) | (uint64_t)(w[s] | w[s + 1] << 8) << 32;
    const uint64_t b = (uint64_t)(w[2 * s] | w[2 * s + 1] << 8) | (uint64_t)(w[3 * s] | w[3 * s + 1] << 8) << 32;
    return _mm256_cvtph_ps(_mm_set_epi64x((long long)b, (long long)a));
  }
  uint32_t h[4] = {0};
  for (int jj = 0; jj < have; jj++) {
    const uint8_t *blk = w + jj * QUAD_BLOCK_BYTES(type);
    h[jj] = type == Q4_1 ? u32le(blk) : (uint32_t)blk[0] | (uint32_t)blk[1] << 8;
  }
  return _mm256_cvtph_ps(_mm_setr_epi32((int)h[0], (int)h[1], (int)h[2], (int)h[3]));
}
#endif

#if PATH == 2 && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define QUAD_512 1
/* A group's weights: u of elements 0..15 (lo) and 16..31 (hi) of its four blocks side by side, and the blocks' d
 * and m as floats ([d0, m0, .., d3, m3]). `have` blocks are read (4 but in a short last group). */
/* Bytes from..from + 64 of a group of n bytes at w, zeros past n (no byte past the group is touched). */
INLINE __m512i quad_load(const uint8_t *w, int n, int from) {
  const int m = n - from >= 64 ? 64 : n - from > 0 ? n - from : 0;
  return m == 64 ? _mm512_loadu_si512(w + from) : _mm512_maskz_loadu_epi8(_cvtu64_mask64((1ull << m) - 1), w + from);
}

/* Byte index vector of the gathers below: byte 16 jj + e of the result takes byte base + stride jj + e of the
 * sources (e < 16; constants once inlined). */
INLINE __m512i quad_gather_index(int base, int stride) {
  uint8_t idx[64];
  for (int p = 0; p < 64; p++) idx[p] = (uint8_t)((base + stride * (p / 16) + p % 16) & 127);
  return _mm512_loadu_si512(idx);
}

/* Word index vector: words 0..7 take words w0..w7 of the sources (the rest word 0). */
INLINE __m512i quad_word_index(int w0, int w1, int w2, int w3, int w4, int w5, int w6, int w7) {
  const uint16_t idx[32] = {(uint16_t)w0, (uint16_t)w1, (uint16_t)w2, (uint16_t)w3,
                            (uint16_t)w4, (uint16_t)w5, (uint16_t)w6, (uint16_t)w7};
  return _mm512_loadu_si512(idx);
}

INLINE void quad_weights(const int64_t type, const uint8_t *row, int64_t gi, int have, __m512i *lo, __m512i *hi,
                         __m256 *dm) {
  const uint8_t *w = row + gi * 4 * QUAD_BLOCK_BYTES(type);
  if (type == Q6_K) { /* half gi % 2 of a super-block: q6_values' four sub-blocks, u = q6 */
    const uint8_t *sb = row + gi / 2 * 210, *qh = sb + 128 + 32 * (gi % 2);
    const __m512i ql = _mm512_loadu_si512(sb + 64 * (gi % 2)), m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(3);
    /* sub-blocks 0..3: low nibbles of ql 0..31, of 32..63, high nibbles of 0..31, of 32..63; qh's bits 2 jj, 2 jj + 1 */
    const __m512i a = _mm512_shuffle_i64x2(ql, ql, _MM_SHUFFLE(2, 0, 2, 0)); /* ql 0..15, 32..47, 0..15, 32..47 */
    const __m512i b = _mm512_shuffle_i64x2(ql, ql, _MM_SHUFFLE(3, 1, 3, 1)); /* ql 16..31, 48..63, twice */
    const __m512i cnt = _mm512_setr_epi64(0, 0, 0x0002000200020002LL, 0x0002000200020002LL, 0x0004000400040004LL,
                                          0x0004000400040004LL, 0x0006000600060006LL, 0x0006000600060006LL);
    const __m512i hl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)qh));
    const __m512i hh = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(qh + 16)));
    const __m512i nl = _mm512_mask_blend_epi64(0xF0, _mm512_and_si512(a, m4), _mm512_and_si512(_mm512_srli_epi16(a, 4), m4));
    const __m512i nh = _mm512_mask_blend_epi64(0xF0, _mm512_and_si512(b, m4), _mm512_and_si512(_mm512_srli_epi16(b, 4), m4));
    *lo = _mm512_or_si512(nl, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hl, cnt), m2), 4));
    *hi = _mm512_or_si512(nh, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hh, cnt), m2), 4));
    *dm = quad_scales(type, row, gi, have);
    return;
  }
  if (type == Q4_K) { /* half gi % 2 of a super-block: sub-blocks 0, 1 the low and high nibbles of bytes 0..31 */
    const __m512i q = _mm512_loadu_si512(row + gi / 2 * 144 + 16 + 64 * (gi % 2)), m4 = _mm512_set1_epi8(0x0F);
    const __m512i a = _mm512_shuffle_i64x2(q, q, _MM_SHUFFLE(2, 2, 0, 0)); /* bytes 0..15 twice, 32..47 twice */
    const __m512i b = _mm512_shuffle_i64x2(q, q, _MM_SHUFFLE(3, 3, 1, 1)); /* bytes 16..31 twice, 48..63 twice */
    *lo = _mm512_mask_blend_epi64(0xCC, _mm512_and_si512(a, m4), _mm512_and_si512(_mm512_srli_epi16(a, 4), m4));
    *hi = _mm512_mask_blend_epi64(0xCC, _mm512_and_si512(b, m4), _mm512_and_si512(_mm512_srli_epi16(b, 4), m4));
    *dm = quad_scales(type, row, gi, have);
    return;
  }
  if (type == Q5_0) { /* 22-byte blocks: half d, 32 fifth bits, 16 bytes of nibbles; 88 bytes a group */
    const int n = QUAD_BLOCK_BYTES(Q5_0) * have;
    const __m512i a = quad_load(w, n, 0), b = quad_load(w, n, 64), m4 = _mm512_set1_epi8(0x0F);
    const __m512i q = _mm512_permutex2var_epi8(a, quad_gather_index(6, 22), b);
    /* words 1 + 11 jj and 2 + 11 jj: block jj's fifth bits of elements 0..15 and 16..31; words 11 jj: its d */
    const __m512i bits = _mm512_permutex2var_epi16(
        a, quad_word_index(1, 12, 23, 34, 2, 13, 24, 35), b);
    const __m128i kb = _mm512_castsi512_si128(bits);
    const __mmask64 klo = _cvtu64_mask64((uint64_t)_mm_cvtsi128_si64(kb)), khi = _cvtu64_mask64((uint64_t)_mm_extract_epi64(kb, 1));
    const __m512i fifth = _mm512_set1_epi8(0x10);
    *lo = _mm512_mask_add_epi8(_mm512_and_si512(q, m4), klo, _mm512_and_si512(q, m4), fifth);
    const __m512i h = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
    *hi = _mm512_mask_add_epi8(h, khi, h, fifth);
    *dm = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_maskz_permutex2var_epi16(
        0x55, a, quad_word_index(0, 0, 11, 0, 22, 0, 33, 0), b)));
    return;
  }
  if (type == Q8_0) { /* 34-byte blocks: half d, 32 signed bytes; 136 bytes a group */
    const int n = QUAD_BLOCK_BYTES(Q8_0) * have;
    const __m512i a = quad_load(w, n, 0), b = quad_load(w, n, 64), c = quad_load(w, n, 128);
    const __m512i top = _mm512_set1_epi8((char)0x80);
    *lo = _mm512_xor_si512(_mm512_permutex2var_epi8(a, quad_gather_index(2, 34), b), top);
    /* block 3's elements 24..31 (bytes 128..135) come from c */
    const __m512i h = _mm512_permutex2var_epi8(a, quad_gather_index(18, 34), b);
    *hi = _mm512_xor_si512(_mm512_mask_permutexvar_epi8(h, 0xFF00000000000000ull, quad_gather_index(-8, 0), c), top);
    *dm = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_maskz_permutex2var_epi16(
        0x55, a, quad_word_index(0, 0, 17, 0, 34, 0, 51, 0), b)));
    return;
  }
  /* Q4_1: byte p of the nibbles: block p / 16's byte p % 16; words 10 jj and 10 jj + 1: block jj's d and m */
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
    a = _mm512_maskz_loadu_epi8(_cvtu64_mask64((1ull << (QUAD_BLOCK_BYTES(Q4_1) * have)) - 1), w);
    b = _mm512_setzero_si512();
  }
  const __m512i q = _mm512_permutex2var_epi8(a, qidx, b), m4 = _mm512_set1_epi8(0x0F);
  *lo = _mm512_and_si512(q, m4);
  *hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
  *dm = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi16(widx, a)));
}

/* Lane 4 jj + l of a group takes word 2 jj + half of v ([d0, m0, .., d3, m3]: half 0 each block's d, or Q6_K's
 * [d sc of lo, of hi] per block: half 0 lo's, 1 hi's). */
INLINE __m512 quad_lane_words(__m256 v, int half) {
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  return _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(half)), _mm512_castps256_ps512(v));
}

/* Q6_K's row step: acc lo's sums, acc_hi hi's, each lane's scale of its half (dlo, dhi) times dx. */
INLINE void quad_split_step(__m512 *acc, __m512 *acc_hi, __m512i lo, __m512i hi, __m512 dlo, __m512 dhi,
                            const xquad *x) {
  const __m512 dx = _mm512_load_ps(x->dx);
  const __m512i a = _mm512_dpbusd_epi32(_mm512_load_si512(x->b32lo), lo, _mm512_load_si512(x->lo));
  const __m512i b = _mm512_dpbusd_epi32(_mm512_load_si512(x->b32hi), hi, _mm512_load_si512(x->hi));
  *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(dlo, dx), *acc);
  *acc_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), _mm512_mul_ps(dhi, dx), *acc_hi);
}

/* One row's step on a group: the lanes (starting from x's -c sum q), scaled by d * dx, into acc; with minima
 * d * dx and m * dx * qsum into o. */
INLINE void quad_step(const int64_t type, __m512 *acc, __m256 *o, __m512i lo, __m512i hi, __m256 dm, const xquad *x) {
  const __m512i init = QUAD_BIAS(type) == 128  ? _mm512_load_si512(x->b128)
                       : QUAD_BIAS(type) == 16 ? _mm512_load_si512(x->b16)
                                               : _mm512_setzero_si512();
  const __m512i lanes =
      _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init, lo, _mm512_load_si512(x->lo)), hi, _mm512_load_si512(x->hi));
  const __m256 s = _mm256_mul_ps(dm, _mm256_load_ps(x->s));
  *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), quad_lane_words(s, 0), *acc);
  if (QUAD_MIN(type)) *o = _mm256_add_ps(*o, s);
}

/* C columns (at w, C * ... row_bytes apart) times R rows of x (groups apart), into y: R * C sums in registers. */
INLINE void quad_tile(const int64_t type, const int C, const int R, const uint8_t *w, int64_t row_bytes, int64_t k,
                      const xquad *g, int64_t groups, void *y, int64_t index, int64_t y_stride, int y_bf16) {
  const int64_t blocks = k / QK;
  __m512 acc[2][FEW_ROWS], acc_hi[2][FEW_ROWS];
  __m256 o[2][FEW_ROWS];
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++)
      acc[c][r] = acc_hi[c][r] = _mm512_setzero_ps(), o[c][r] = _mm256_setzero_ps();
  for (int64_t gi = 0; gi < groups; gi++) {
    const int have = blocks - 4 * gi < 4 ? (int)(blocks - 4 * gi) : 4;
    for (int c = 0; c < C; c++) {
      __m512i lo, hi;
      __m256 dm;
      quad_weights(type, w + c * row_bytes, gi, have, &lo, &hi, &dm);
      if (QUAD_SPLIT(type)) {
        const __m512 dlo = quad_lane_words(dm, 0), dhi = quad_lane_words(dm, 1);
        for (int r = 0; r < R; r++) quad_split_step(&acc[c][r], &acc_hi[c][r], lo, hi, dlo, dhi, g + r * groups + gi);
      } else {
        for (int r = 0; r < R; r++) quad_step(type, &acc[c][r], &o[c][r], lo, hi, dm, g + r * groups + gi);
      }
    }
  }
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++) {
      const __m512 a = QUAD_SPLIT(type) ? _mm512_add_ps(acc[c][r], acc_hi[c][r]) : acc[c][r];
      const float v = quad_reduce_v(_mm512_castps512_ps256(a),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)), o[c][r],
                                    QUAD_MIN(type));
      store_value(v, y, r * y_stride + index + c, y_bf16);
    }
}
#elif PATH >= 1
/* A group's weights as two pairs of blocks (0, 1 and 2, 3): u of elements 0..15 (lo) and 16..31 (hi) of the pair
 * side by side, and the blocks' d and m as floats ([d0, m0, .., d3, m3]); missing blocks read as zeros. On AVX2
 * without VNNI, Q8_0's lo and hi are the signed w instead (whose signs go onto x's q), and |w| the unsigned
 * operand. */
typedef struct {
  __m256i lo[2], hi[2];
#if PATH == 1
  __m256i alo[2], ahi[2]; /* Q8_0's |w| of lo and hi, for a pass of several rows (one row takes it in its lanes) */
#endif
  __m256 dm;
  __m256 dlo[2], dhi[2]; /* Q6_K: each lane's d sc of its lo half and of its hi half, pair by pair */
} quad_w;

/* Lanes 8 p .. 8 p + 7 (blocks 2 p, 2 p + 1, four lanes each) take words 4 p + half and 4 p + 2 + half of v (as
 * quad_lane_words, pair p's half of it). */
INLINE __m256 quad_pair_words(__m256 v, int p, int half) {
  const int a = 4 * p + half, b = a + 2;
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(a, a, a, a, b, b, b, b));
}

/* A pair of whole Q5_0 blocks (at a, b) as quad_weights' lo and hi: the pair's 32 bytes of nibbles in one register
 * (a's in the low lane, b's in the high one: their low nibbles are lo's elements, their high nibbles hi's, as x's
 * pairs lie), and the fifth bits of both blocks as one 64-bit word, broadcast once and spread to the bytes of lo
 * and of hi. 17 vector operations a pair, where a fives_v per block and the two lane permutes took 24: on a
 * 2-core Zen 3 the one-row GEMV is bound by them, not by memory (pagedkernel README, cpu backend). */
INLINE void q5_pair(const uint8_t *a, const uint8_t *b, __m256i *lo, __m256i *hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + 6))),
                                            _mm_loadu_si128((const __m128i *)(b + 6)), 1);
  const uint64_t ha = u32le(a + 2), hb = u32le(b + 2);
  /* bytes 0, 1: a's bits of elements 0..15, bytes 2, 3: b's; bytes 4, 5: a's of 16..31, bytes 6, 7: b's */
  const uint64_t h = (ha & 0xFFFFu) | (hb & 0xFFFFu) << 16 | (ha >> 16) << 32 | (hb >> 16) << 48;
  const __m256i hv = _mm256_set1_epi64x((long long)h);
  /* byte j of the pair takes bit j % 8 of byte j / 8 of h (lo) or of byte 4 + j / 8 (hi) */
  const __m256i blo = spread_bits(hv, SPREAD4), bhi = spread_bits(hv, _mm256_add_epi8(SPREAD4, _mm256_set1_epi8(4)));
  *lo = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(blo, fifth));
  *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_and_si256(bhi, fifth));
}

INLINE void quad_weights(const int64_t type, const uint8_t *row, int64_t gi, int have, quad_w *q, int rows) {
  q->dm = quad_scales(type, row, gi, have);
  if (type == Q5_0 && have == 4) {
    const uint8_t *w = row + gi * 4 * QUAD_BLOCK_BYTES(Q5_0);
    for (int p = 0; p < 2; p++)
      q5_pair(w + 2 * p * QUAD_BLOCK_BYTES(Q5_0), w + (2 * p + 1) * QUAD_BLOCK_BYTES(Q5_0), &q->lo[p], &q->hi[p]);
    return;
  }
  if (type == Q6_K) { /* pair 0: sub-blocks 0, 1 (low nibbles of ql 0..31, 32..63), pair 1: 2, 3 (high nibbles) */
    const uint8_t *sb = row + gi / 2 * 210, *ql = sb + 64 * (gi % 2), *qh = sb + 128 + 32 * (gi % 2);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    /* bits 2 s, 2 s + 1 of qh's bytes as bits 4, 5: pair 0 takes s = 0 (low lane), 1 (high); pair 1 s = 2, 3. A
     * 64-bit shift moves no wanted bit across a byte (the mask keeps bits 4, 5, which came from the same byte). */
    const __m256i up = _mm256_setr_epi64x(4, 4, 2, 2), down = _mm256_setr_epi64x(0, 0, 2, 2);
    for (int half = 0; half < 2; half++) { /* elements 0..15 (lo), 16..31 (hi) */
      const __m256i v = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(ql + 16 * half))),
          _mm_loadu_si128((const __m128i *)(ql + 32 + 16 * half)), 1);
      const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(qh + 16 * half)));
      const __m256i p0 = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_sllv_epi64(h, up), m30));
      const __m256i p1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                         _mm256_and_si256(_mm256_srlv_epi64(h, down), m30));
      if (half == 0) q->lo[0] = p0, q->lo[1] = p1;
      else q->hi[0] = p0, q->hi[1] = p1;
    }
    for (int p = 0; p < 2; p++) q->dlo[p] = quad_pair_words(q->dm, p, 0), q->dhi[p] = quad_pair_words(q->dm, p, 1);
    return;
  }
  if (type == Q4_K) { /* pair p: sub-blocks 2p, 2p + 1, the low and high nibbles of bytes 32p .. 32p + 31 */
    const uint8_t *qs = row + gi / 2 * 144 + 16 + 64 * (gi % 2);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int p = 0; p < 2; p++) { /* one load a pair: low and high nibbles of bytes 0..31, then their lanes swapped */
      const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
      const __m256i a = _mm256_and_si256(v, m4), b = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      q->lo[p] = _mm256_permute2x128_si256(a, b, 0x20); /* low nibbles of bytes 0..15, then their high nibbles */
      q->hi[p] = _mm256_permute2x128_si256(a, b, 0x31); /* the same of bytes 16..31 */
    }
    return;
  }
  const uint8_t *w = row + gi * 4 * QUAD_BLOCK_BYTES(type);
  if (type != Q4_1) {
    __m256i v[4];
    for (int jj = 0; jj < 4; jj++) {
      const uint8_t *blk = w + jj * QUAD_BLOCK_BYTES(type);
#if PATH == 1
      if (type == Q8_0) { /* the signed bytes as stored */
        v[jj] = jj < have ? _mm256_loadu_si256((const __m256i *)(blk + 2)) : _mm256_setzero_si256();
        continue;
      }
#endif
      v[jj] = jj < have ? quad_block_v(type, blk) : _mm256_setzero_si256();
    }
    for (int p = 0; p < 2; p++) {
      q->lo[p] = _mm256_permute2x128_si256(v[2 * p], v[2 * p + 1], 0x20);
      q->hi[p] = _mm256_permute2x128_si256(v[2 * p], v[2 * p + 1], 0x31);
#if PATH == 1
      if (type == Q8_0 && rows > 1) q->alo[p] = _mm256_abs_epi8(q->lo[p]), q->ahi[p] = _mm256_abs_epi8(q->hi[p]);
#endif
    }
    (void)rows;
    return;
  }
  __m128i qs[4];
  for (int jj = 0; jj < 4; jj++)
    qs[jj] = jj < have ? _mm_loadu_si128((const __m128i *)(w + jj * QUAD_BLOCK_BYTES(Q4_1) + 4)) : _mm_setzero_si128();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int p = 0; p < 2; p++) {
    const __m256i b = _mm256_set_m128i(qs[2 * p + 1], qs[2 * p]);
    q->lo[p] = _mm256_and_si256(b, m4);
    q->hi[p] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
  }
}

/* The integer lanes of pair p (lanes 8 p .. 8 p + 7 of the group), exact: with VNNI vpdpbusd of u by q from x's
 * -c sum q; on AVX2 u by q in 16-bit pair sums (15 or 31 * 127 * 2 fits), plus -c sum q, and for Q8_0 (u up to
 * 255 would saturate) |w| by q with w's signs (128 * 127 * 2 fits), which needs no correction. */
INLINE __m256i quad_lanes(const int64_t type, const quad_w *q, const xquad *x, int p, int rows) {
  const __m256i a = _mm256_load_si256((const __m256i *)(x->lo + 32 * p));
  const __m256i b = _mm256_load_si256((const __m256i *)(x->hi + 32 * p));
  const __m256i init = QUAD_BIAS(type) == 128  ? _mm256_load_si256((const __m256i *)(x->b128 + 8 * p))
                       : QUAD_BIAS(type) == 16 ? _mm256_load_si256((const __m256i *)(x->b16 + 8 * p))
                                               : _mm256_setzero_si256();
#if PATH == 2
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(init, q->lo[p], a), q->hi[p], b);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if (type == Q8_0) {
    /* one row: |w| here, so that a group holds four vectors of weights, not eight (which spilled its sums) */
    const __m256i ulo = rows > 1 ? q->alo[p] : _mm256_abs_epi8(q->lo[p]);
    const __m256i uhi = rows > 1 ? q->ahi[p] : _mm256_abs_epi8(q->hi[p]);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(ulo, _mm256_sign_epi8(a, q->lo[p])), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(uhi, _mm256_sign_epi8(b, q->hi[p])), ones));
  }
  /* u <= 31: each 16-bit pair sum is at most 2 * 31 * 127, so lo's and hi's add in 16 bits (one madd, exact) */
  return _mm256_add_epi32(init, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(q->lo[p], a),
                                                                    _mm256_maddubs_epi16(q->hi[p], b)),
                                                   ones));
#endif
}

/* Q6_K's integer lanes of pair p: lo's and hi's apart, each from its -32 sum q. */
INLINE void quad_split_lanes(const quad_w *q, const xquad *x, int p, __m256i *a, __m256i *b) {
  const __m256i xl = _mm256_load_si256((const __m256i *)(x->lo + 32 * p));
  const __m256i xh = _mm256_load_si256((const __m256i *)(x->hi + 32 * p));
  const __m256i bl = _mm256_load_si256((const __m256i *)(x->b32lo + 8 * p));
  const __m256i bh = _mm256_load_si256((const __m256i *)(x->b32hi + 8 * p));
#if PATH == 2
  *a = _mm256_dpbusd_epi32(bl, q->lo[p], xl);
  *b = _mm256_dpbusd_epi32(bh, q->hi[p], xh);
#else /* u <= 63: 63 * 127 * 2 fits the 16-bit pair sums */
  const __m256i ones = _mm256_set1_epi16(1);
  *a = _mm256_add_epi32(bl, _mm256_madd_epi16(_mm256_maddubs_epi16(q->lo[p], xl), ones));
  *b = _mm256_add_epi32(bh, _mm256_madd_epi16(_mm256_maddubs_epi16(q->hi[p], xh), ones));
#endif
}

INLINE void quad_step(const int64_t type, __m256 acc[2], __m256 acc_hi[2], __m256 *o, const quad_w *q,
                      const xquad *x, int rows) {
  if (QUAD_SPLIT(type)) { /* each lane's scale of its half ([dlo, dhi] per block in dm) times dx */
    for (int p = 0; p < 2; p++) {
      __m256i a, b;
      quad_split_lanes(q, x, p, &a, &b);
      const __m256 dx = _mm256_load_ps(x->dx + 8 * p);
      const __m256 sl = _mm256_mul_ps(q->dlo[p], dx), sh = _mm256_mul_ps(q->dhi[p], dx);
      acc[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), sl, acc[p]);
      acc_hi[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), sh, acc_hi[p]);
    }
    return;
  }
  const __m256 s = _mm256_mul_ps(q->dm, _mm256_load_ps(x->s));
  for (int p = 0; p < 2; p++) {
    const __m256i lanes = quad_lanes(type, q, x, p, rows);
    acc[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), quad_pair_words(s, p, 0), acc[p]);
  }
  if (QUAD_MIN(type)) *o = _mm256_add_ps(*o, s);
}

INLINE void quad_tile(const int64_t type, const int C, const int R, const uint8_t *w, int64_t row_bytes, int64_t k,
                      const xquad *g, int64_t groups, void *y, int64_t index, int64_t y_stride, int y_bf16) {
  const int64_t blocks = k / QK;
  __m256 acc[4][FEW_ROWS][2], acc_hi[4][FEW_ROWS][2]; /* C <= 4 columns */
  __m256 o[4][FEW_ROWS];
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++)
      acc[c][r][0] = acc[c][r][1] = acc_hi[c][r][0] = acc_hi[c][r][1] = o[c][r] = _mm256_setzero_ps();
  for (int64_t gi = 0; gi < groups; gi++) {
    const int have = blocks - 4 * gi < 4 ? (int)(blocks - 4 * gi) : 4;
    for (int c = 0; c < C; c++) {
      quad_w q;
      quad_weights(type, w + c * row_bytes, gi, have, &q, R);
      for (int r = 0; r < R; r++) quad_step(type, acc[c][r], acc_hi[c][r], &o[c][r], &q, g + r * groups + gi, R);
    }
  }
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++) {
      __m256 a0 = acc[c][r][0], a1 = acc[c][r][1];
      if (QUAD_SPLIT(type)) a0 = _mm256_add_ps(a0, acc_hi[c][r][0]), a1 = _mm256_add_ps(a1, acc_hi[c][r][1]);
      store_value(quad_reduce_v(a0, a1, o[c][r], QUAD_MIN(type)), y, r * y_stride + index + c, y_bf16);
    }
}
#endif

#if PATH >= 1
/* Columns index..index + C of y (C at wrow, row_bytes apart) for every row of x, in passes of `pass` rows (<=
 * FEW_ROWS): each pass one quad_tile, R a constant in each call. */
#define QUAD_TILE(R) quad_tile(type, C, R, wrow, row_bytes, k, gr, groups, yr, index, y_stride, y_bf16)
INLINE void quad_passes(const int64_t type, const int C, const int64_t pass, const uint8_t *wrow, int64_t row_bytes,
                        int64_t k, const xquad *g, int64_t groups, int64_t rows, void *y, int64_t index,
                        int64_t y_stride, int y_bf16) {
  for (int64_t r0 = 0; r0 < rows; r0 += pass) {
    const xquad *gr = g + r0 * groups;
    void *yr = y_row(y, r0, y_stride, y_bf16);
    FOR_PASS_ROWS(rows, r0, pass, QUAD_TILE)
  }
}
#undef QUAD_TILE
#endif

/* Columns j0..j1 of y for any rows of a quad-order format: rows in passes of FEW_ROWS, one row two columns at a
 * time (two independent sum chains; four for Q5_0 on the 256-bit form); the plain path one output at a time. */
INLINE void quad_columns(const int64_t type, const uint8_t *weight, int64_t j0, int64_t j1, int64_t k,
                         const xquad *g, int64_t rows, void *y, int64_t y_stride, int y_bf16) {
  int elems, bytes, has_offset;
  type_info(type, &elems, &bytes, &has_offset);
  const int64_t groups = quad_groups(k), row_bytes = k / elems * bytes;
#if PATH >= 1
  prefetch_start(weight + j0 * row_bytes);
  int64_t j = j0;
  /* Two columns share each pass over up to 4 rows of x where that pays:
   * - up to 3 rows (one on the 256-bit form): two independent sum chains a row (measured on Zen 4 at 2 and 3
   *   rows: 10-25% faster than one column; at 4 the registers run out);
   * - Q6_K from 8 rows: it reads five lines of x a group and row, and eight rows of a long row of x (2048: 40 KB)
   *   spill out of L1 while a column sweeps them (0.097 ms for 8 rows of Gemma 3's down projection against 0.072
   *   for 7); two columns a pass of 4 rows: 0.081 ms, 16 rows 0.151 against 0.231 ms.
   * On the 256-bit form one row of Q5_0 takes four columns a pass: four independent chains overlap the fifth
   * bits' unpacking (measured on a 2-core Zen 3, AVX2: Gemma 3's gate 63 -> 57 us, its query 34 -> 32 us; Q4_1,
   * Q8_0, Q4_K and Q6_K level or slower, so they keep two). */
#ifdef QUAD_512
  const int two_columns = rows <= 3 || (QUAD_SPLIT(type) && rows >= 8);
#else
  const int two_columns = rows == 1;
  for (; rows == 1 && type == Q5_0 && j + 4 <= j1; j += 4) {
    prefetch_ahead(weight + j * row_bytes, 4 * row_bytes);
    quad_passes(type, 4, 4, weight + j * row_bytes, row_bytes, k, g, groups, rows, y, j, y_stride, y_bf16);
  }
#endif
  for (; two_columns && j + 2 <= j1; j += 2) {
    prefetch_ahead(weight + j * row_bytes, 2 * row_bytes);
    quad_passes(type, 2, 4, weight + j * row_bytes, row_bytes, k, g, groups, rows, y, j, y_stride, y_bf16);
  }
  /* The 256-bit form holds a row's Q6_K sums in four registers of sixteen: passes of 4 rows (8 spilled them). */
#ifdef QUAD_512
  const int64_t pass = FEW_ROWS;
#else
  const int64_t pass = QUAD_SPLIT(type) ? 4 : FEW_ROWS;
#endif
  for (; j < j1; j++) {
    prefetch_ahead(weight + j * row_bytes, row_bytes);
    quad_passes(type, 1, pass, weight + j * row_bytes, row_bytes, k, g, groups, rows, y, j, y_stride, y_bf16);
  }
#else
  for (int64_t j = j0; j < j1; j++)
    for (int64_t r = 0; r < rows; r++)
      store_value(quad_dot(type, weight + j * row_bytes, k / QK, g + r * groups), y, r * y_stride + j, y_bf16);
#endif
}
