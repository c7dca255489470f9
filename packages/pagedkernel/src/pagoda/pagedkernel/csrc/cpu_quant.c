/* GGUF quantized weights on the CPU: dequantize, and y[rows, n] = x[rows, k] @ W^T with W [n, k] in a GGUF type.
 *
 * The specification is pagoda/pagedkernel/quant/torch_quant.py (after gguf's reference). Every block is first
 * unpacked into signed 8-bit values w, a scale per 16 elements and, for the formats with a minimum, an offset per
 * 32 elements, so that value = scale * w (+ offset). Dequantization evaluates exactly that, in the reference's
 * order, so it is bit-exact (the library is built with -ffp-contract=off: no fused multiply-add).
 *
 * The matmul quantizes each row of x to int8 per 32 elements (dx = max|x| / 127, q = round(x / dx), as llama.cpp's
 * Q8_0 does, plus the sum of the q for the offsets) and streams each weight block once, unpacking it once for all
 * rows. The 32-element dot products are integers, computed as eight lanes of four products:
 *   - PATH 2, AVX-512 VNNI (with VL): vpdpbusd of x stored as q + 128 (unsigned) by w, less 128 times w's lane
 *     sums; a one-row call of a 32-element format swaps the roles (w + 128 by q, less 128 times q's lane sums,
 *     made once per row: prepare_x);
 *   - PATH 1, AVX2: vpmaddubsw then vpmaddwd on the same operands (|w| <= 128, |x| <= 127: no saturation);
 *   - PATH 0, generic C: the same eight lane sums in scalar code.
 * The lanes are exact, and the float steps after them are the same operations in the same order on every path,
 * so the three paths give bitwise the same y (tested). Q4_1, Q5_0, Q8_0, Q4_K and Q6_K take another order, four
 * blocks at a time and the same on every path too (cpu_quad.h: the per-block form was bound by instructions per
 * block and row, not by memory); the per-block form remains Q4_0's, Q5_1's, Q5_K's and the int4 group formats'.
 * The path is chosen by the target's features at build (-march=native picks the best this CPU has);
 * pagoda_quant_path() says which one was compiled.
 *
 * Many rows of bfloat16 x go to pagoda_quant_matmul_amx where the target has AMX (at the end of this file).
 *
 * Columns of y are split over torch's OpenMP pool (the library links the libgomp torch has loaded); each output
 * is computed whole by one thread, so y does not depend on the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX2__)
#define PATH 2
#elif defined(__AVX2__) && defined(__FMA__) /* the quad order's fused multiply-add (every AVX2 x86-64 has it) */
#define PATH 1
#else
#define PATH 0
#endif

/* GGUF type ids (gguf's GGMLQuantizationType), and Pagoda's own int4 group formats (formats.py). */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, I4_G64 = 1064, I4_G128 = 1128,
       Q8_0_R16 = 1208, Q4_1_R16 = 1203, Q5_0_R16 = 1206, Q4_K_R16 = 1212,
       Q6_K_R16 = 1214 };

#define QK 32        /* elements per activation block (and per block of the 32-element formats) */
#define QK_K 256     /* elements per K-quant super-block */
#define MAX_ROWS 16  /* rows of x that share one unpacked weight block */

int pagoda_quant_path(void) { return PATH; }

/* Elements and bytes per block, and whether values carry an offset (a minimum); 0 elements: unknown type. */
static void type_info(int64_t type, int *elems, int *bytes, int *has_offset) {
  *elems = 0;
  *bytes = 0;
  *has_offset = type == Q4_1 || type == Q5_1 || type == Q4_K || type == Q5_K || type == I4_G64 || type == I4_G128 ||
                type == Q4_1_R16 || type == Q4_K_R16;
  switch (type) {
    case Q4_0: *elems = QK, *bytes = 18; break;
    case Q4_1: *elems = QK, *bytes = 20; break;
    case Q5_0: *elems = QK, *bytes = 22; break;
    case Q5_1: *elems = QK, *bytes = 24; break;
    case Q8_0: *elems = QK, *bytes = 34; break;
    /* per row and block, as their formats (cpu_rows16.h) */
    case Q8_0_R16: *elems = QK, *bytes = 34; break;
    case Q4_1_R16: *elems = QK, *bytes = 20; break;
    case Q5_0_R16: *elems = QK, *bytes = 22; break;
    case Q4_K_R16: *elems = QK_K, *bytes = 144; break;
    case Q6_K_R16: *elems = QK_K, *bytes = 210; break;
    case Q4_K: *elems = QK_K, *bytes = 144; break;
    case Q5_K: *elems = QK_K, *bytes = 176; break;
    case Q6_K: *elems = QK_K, *bytes = 210; break;
    case I4_G64: *elems = 64, *bytes = 4 + 32; break;
    case I4_G128: *elems = 128, *bytes = 4 + 64; break;
    default: break;
  }
}

/* A little-endian IEEE half as float (exact: every half is a float). */
static inline float f16(const uint8_t *p) {
  uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13); /* inf, or NaN with its payload */
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else { /* a subnormal half is a normal float: shift its leading 1 into the implicit bit */
    uint32_t e = 0;
    while (!(man & 0x400u)) man <<= 1, e++;
    bits = sign | ((113 - e) << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

static inline uint32_t u32le(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

#define INLINE static inline __attribute__((always_inline))

/* The weight unpackers below write the same bytes on every path: intrinsics with AVX2, plain loops without. */

#if PATH >= 1
/* The 32 nibbles of 16 bytes as bytes: element j < 16 is byte j's low nibble, element 16 + j its high nibble. */
INLINE __m256i nibbles_v(const uint8_t *qs) {
  const __m128i m4 = _mm_set1_epi8(0x0F), q = _mm_loadu_si128((const __m128i *)qs);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}
#endif

/* Element j < 16 is byte j's low nibble, element 16 + j its high nibble, minus bias. */
INLINE void nibbles32(const uint8_t *qs, int8_t *w, int bias) {
#if PATH >= 1
  _mm256_storeu_si256((__m256i *)w, _mm256_sub_epi8(nibbles_v(qs), _mm256_set1_epi8((char)bias)));
#else
  for (int j = 0; j < 16; j++) {
    w[j] = (int8_t)((qs[j] & 0x0F) - bias);
    w[j + 16] = (int8_t)((qs[j] >> 4) - bias);
  }
#endif
}

#if PATH >= 1
/* Byte j is 0xFF where bit j % 8 of byte spread[j] of hv's lane is set, else 0 (spread: byte indices < 16). */
static inline __m256i spread_bits(__m256i hv, __m256i spread) {
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL); /* byte j tests bit j % 8 */
  return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(hv, spread), bit), bit);
}

/* byte j: j / 8 (bytes 0..3 of a word, eight times each) */
#define SPREAD4 _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL)

/* Byte j is 0xFF where bit j of the 32-bit word h is set, else 0. */
static inline __m256i bit_bytes(uint32_t h) { return spread_bits(_mm256_set1_epi32((int)h), SPREAD4); }
#endif

#if PATH >= 1
/* Q5_0 / Q5_1's 5-bit values: the low nibbles plus bit j of the 32-bit word at qh as bit 4 of element j. */
INLINE __m256i fives_v(const uint8_t *qh, const uint8_t *qs) {
  return _mm256_or_si256(nibbles_v(qs), _mm256_and_si256(bit_bytes(u32le(qh)), _mm256_set1_epi8(0x10)));
}
#endif

/* Q5_0 / Q5_1: the low nibbles plus bit j of the 32-bit word qh as bit 4 of element j, minus bias. */
INLINE void fives32(const uint8_t *qh, const uint8_t *qs, int8_t *w, int bias) {
#if PATH >= 1
  _mm256_storeu_si256((__m256i *)w, _mm256_sub_epi8(fives_v(qh, qs), _mm256_set1_epi8((char)bias)));
#else
  uint32_t h = u32le(qh);
  for (int j = 0; j < 16; j++) {
    w[j] = (int8_t)(((qs[j] & 0x0F) | (((h >> j) & 1u) << 4)) - bias);
    w[j + 16] = (int8_t)(((qs[j] >> 4) | (((h >> (j + 16)) & 1u) << 4)) - bias);
  }
#endif
}

/* Q4_K / Q5_K values (0..15 or 0..31) of a super-block: four 32-byte groups of qs whose low nibbles are
 * sub-block 2g and high nibbles 2g + 1; with qh (Q5_K), bit s of qh[j] is bit 4 of element j of sub-block s. */
INLINE void k_values(const uint8_t *qs, const uint8_t *qh, int8_t *w) {
#if PATH >= 1
  const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const __m256i hb = qh ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
  for (int g = 0; g < 4; g++) {
    __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
    __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if (qh) { /* 16-bit shifts, then one bit per byte: each byte keeps its own bit */
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * g), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * g + 1), one), 4));
    }
    _mm256_storeu_si256((__m256i *)(w + 64 * g), lo);
    _mm256_storeu_si256((__m256i *)(w + 64 * g + 32), hi);
  }
#else
  for (int g = 0; g < 4; g++) {
    for (int j = 0; j < 32; j++) {
      int lo = qs[32 * g + j] & 0x0F, hi = qs[32 * g + j] >> 4;
      if (qh) lo |= ((qh[j] >> (2 * g)) & 1) << 4, hi |= ((qh[j] >> (2 * g + 1)) & 1) << 4;
      w[64 * g + j] = (int8_t)lo;
      w[64 * g + 32 + j] = (int8_t)hi;
    }
  }
#endif
}

/* Q6_K values minus 32: per half of 128, 64 bytes of low nibbles and 32 bytes of four 2-bit highs. */
INLINE void q6_values(const uint8_t *ql, const uint8_t *qh, int8_t *w) {
#if PATH >= 1
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
  for (int h = 0; h < 2; h++) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
    __m256i c = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
    __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
    /* (hb >> 2t & 3) << 4, for t = 0..3, as 16-bit shifts masked to each byte's own bits 4-5 */
    __m256i h0 = _mm256_and_si256(_mm256_slli_epi16(hb, 4), m2), h1 = _mm256_and_si256(_mm256_slli_epi16(hb, 2), m2);
    __m256i h2 = _mm256_and_si256(hb, m2), h3 = _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2);
    int8_t *o = w + 128 * h;
    _mm256_storeu_si256((__m256i *)o, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(a, m4), h0), off));
    _mm256_storeu_si256((__m256i *)(o + 32), _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(c, m4), h1), off));
    _mm256_storeu_si256((__m256i *)(o + 64),
                        _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), h2), off));
    _mm256_storeu_si256((__m256i *)(o + 96),
                        _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4), h3), off));
  }
#else
  for (int h = 0; h < 2; h++) {
    for (int p = 0; p < 32; p++) {
      int a = ql[64 * h + p], c = ql[64 * h + 32 + p], hb = qh[32 * h + p];
      int8_t *o = w + 128 * h + p;
      o[0] = (int8_t)(((a & 0x0F) | ((hb & 3) << 4)) - 32);
      o[32] = (int8_t)(((c & 0x0F) | (((hb >> 2) & 3) << 4)) - 32);
      o[64] = (int8_t)(((a >> 4) | (((hb >> 4) & 3) << 4)) - 32);
      o[96] = (int8_t)(((c >> 4) | (((hb >> 6) & 3) << 4)) - 32);
    }
  }
#endif
}

/* The eight 6-bit scales and mins of a Q4_K / Q5_K block (its 12 scale bytes). */
static inline void k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; j++) {
    sc[j] = s[j] & 0x3F;
    mn[j] = s[j + 4] & 0x3F;
    sc[j + 4] = (uint8_t)((s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30));
    mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
  }
}

/* Unpack one block: value i = scale[i / 16] * w[i], plus offset[i / 32] for the formats with a minimum.
 * Always inlined, so that each caller specialised for one type (see pagoda_quant_matmul) keeps only its case. */
INLINE void unpack(int64_t type, const uint8_t *b, int8_t *w, float *scale, float *offset) {
  float d;
  switch (type) {
    case Q4_0:
      d = f16(b), nibbles32(b + 2, w, 8);
      scale[0] = scale[1] = d;
      break;
    case Q4_1:
      d = f16(b), offset[0] = f16(b + 2), nibbles32(b + 4, w, 0);
      scale[0] = scale[1] = d;
      break;
    case Q5_0:
      d = f16(b), fives32(b + 2, b + 6, w, 16);
      scale[0] = scale[1] = d;
      break;
    case Q5_1:
      d = f16(b), offset[0] = f16(b + 2), fives32(b + 4, b + 8, w, 0);
      scale[0] = scale[1] = d;
      break;
    case Q8_0:
      scale[0] = scale[1] = f16(b);
      memcpy(w, b + 2, QK);
      break;
    case I4_G64:
    case I4_G128: { /* one scale and minimum for the group; Q4_1's nibbles per 32 values */
      const int subs = type == I4_G64 ? 2 : 4;
      float m = f16(b + 2);
      d = f16(b);
      for (int s = 0; s < subs; s++) {
        nibbles32(b + 4 + 16 * s, w + QK * s, 0);
        scale[2 * s] = scale[2 * s + 1] = d;
        offset[s] = m;
      }
      break;
    }
    case Q4_K:
    case Q5_K: {
      float dmin = f16(b + 2);
      uint8_t sc[8], mn[8];
      d = f16(b);
      k_scales(b + 4, sc, mn);
      k_values(b + (type == Q5_K ? 48 : 16), type == Q5_K ? b + 16 : NULL, w);
      for (int s = 0; s < 8; s++) {
        scale[2 * s] = scale[2 * s + 1] = d * (float)sc[s];
        offset[s] = -(dmin * (float)mn[s]);
      }
      break;
    }
    case Q6_K: {
      const int8_t *sc = (const int8_t *)(b + 192);
      d = f16(b + 208);
      q6_values(b, b + 128, w);
      for (int g = 0; g < 16; g++) scale[g] = d * (float)sc[g];
      break;
    }
    default:
      break;
  }
}

/* float bits -> bfloat16 bits, rounded to nearest even (as torch converts); a NaN stays a quiet NaN of its sign.
 * A select rather than a branch, so that the loop over a block vectorises. */
static inline uint16_t bf16_bits(uint32_t bits) {
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16, quiet = (bits >> 16) | 0x40u;
  return (uint16_t)((bits & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

typedef uint32_t aliased_u32 __attribute__((may_alias));

/* The values of one unpacked block: scale * w (+ offset), in the reference's order. */
INLINE void values_of(const int8_t *w, const float *scale, const float *offset, int has_offset, int elems,
                      float *restrict out) {
  for (int g = 0; g < elems / 16; g++) { /* sixteen elements share a scale: one vector each */
    const float sg = scale[g], og = has_offset ? offset[g / 2] : 0.0f;
    if (has_offset) {
      for (int j = 16 * g; j < 16 * g + 16; j++) out[j] = sg * (float)w[j] + og;
    } else {
      for (int j = 16 * g; j < 16 * g + 16; j++) out[j] = sg * (float)w[j];
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && PATH >= 1
#define F32_LOOKUPS 1 /* dequantization by block_values (dequantize_blocks): float32, and bfloat16 with BF16 */
/* values_of for elements 16g..16g+31 (two groups of sixteen), as two vectors: the same multiply and add per
 * element. One 32-byte load: the unpackers store 32 bytes at a time, and a narrower load of a wider store's upper
 * half may not be forwarded from it (a stall per block). */
INLINE void scaled_pair(const int8_t *w, const float *scale, const float *offset, int has_offset, int g, __m512 *a,
                        __m512 *b) {
  const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 16 * g));
  *a = _mm512_mul_ps(_mm512_set1_ps(scale[g]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
  *b = _mm512_mul_ps(_mm512_set1_ps(scale[g + 1]),
                     _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
  if (has_offset) {
    const __m512 o = _mm512_set1_ps(offset[g / 2]);
    *a = _mm512_add_ps(*a, o);
    *b = _mm512_add_ps(*b, o);
  }
}

/* values_of sixteen lanes at a time, in explicit vectors (the compiler's own vectorisation of values_of keeps to
 * 256-bit halves and branches per group). */
INLINE void values_f32(const int8_t *w, const float *scale, const float *offset, int has_offset, int elems,
                       float *restrict out) {
  for (int g = 0; g < elems / 16; g += 2) {
    __m512 a, b;
    scaled_pair(w, scale, offset, has_offset, g, &a, &b);
    _mm512_storeu_ps(out + 16 * g, a);
    _mm512_storeu_ps(out + 16 * g + 16, b);
  }
}

/* The float32 values scale * (j - bias) (+ offset) for j = 0..15 (lo) and 16..31 (hi), computed as values_of
 * computes each element (so that a lookup in them is bit-exact). */
INLINE void value_pair(float scale, float offset, int has_offset, int bias, __m512 *lo, __m512 *hi) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 l = _mm512_sub_ps(iota, _mm512_set1_ps((float)bias)), h = _mm512_add_ps(l, _mm512_set1_ps(16.0f));
  *lo = _mm512_mul_ps(_mm512_set1_ps(scale), l);
  *hi = _mm512_mul_ps(_mm512_set1_ps(scale), h);
  if (has_offset) {
    *lo = _mm512_add_ps(*lo, _mm512_set1_ps(offset));
    *hi = _mm512_add_ps(*hi, _mm512_set1_ps(offset));
  }
}
#endif

#if defined(F32_LOOKUPS) && defined(__AVX512BF16__)
#define BF16_LOOKUPS 1 /* bfloat16 rounding in block_values, by the functions below */
/* values_of rounded to bfloat16, sixteen lanes at a time: the same multiply and add, then the instruction's
 * round to nearest even (its flush of float32 subnormals never applies: a nonzero value is at least a float16
 * scale's subnormal, 2^-24, and a difference of two such products a multiple of 2^-48). */
INLINE void values_bf16(const int8_t *w, const float *scale, const float *offset, int has_offset, int elems,
                        uint16_t *restrict out) {
  for (int g = 0; g < elems / 16; g += 2) {
    __m512 a, b;
    scaled_pair(w, scale, offset, has_offset, g, &a, &b);
    _mm512_storeu_si512(out + 16 * g, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
}

/* 32 elements of unsigned codes (bytes < 32) looked up in a value table, stored as bfloat16 at out. */
INLINE void lookup32(__m512i table, __m256i codes, uint16_t *out) {
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), table));
}

#endif

#ifdef F32_LOOKUPS
/* 32 unsigned codes (bytes < 32) looked up in the pair of tables (two permutes), stored as float32 at out. */
INLINE void lookup32_f32(__m512 lo, __m512 hi, __m256i codes, float *out) {
  const __m512i c0 = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(codes));
  const __m512i c1 = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(codes, 1));
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(lo, c0, hi));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(lo, c1, hi));
}

/* 32 codes looked up in a value pair (value_pair): float32 at out, or where out is NULL bfloat16 at out16 (the
 * pair rounded to one 32-entry table, then one permute). */
INLINE void lookup_codes(__m512 lo, __m512 hi, __m256i codes, float *out, uint16_t *out16) {
  (void)out16; /* only read with BF16 */
#ifdef BF16_LOOKUPS
  if (!out) {
    lookup32((__m512i)_mm512_cvtne2ps_pbh(hi, lo), codes, out16);
    return;
  }
#endif
  lookup32_f32(lo, hi, codes, out);
}

/* values_of as float32 at out, or where out is NULL rounded to bfloat16 at out16. */
INLINE void values_to(const int8_t *w, const float *scale, const float *offset, int has_offset, int elems,
                      float *out, uint16_t *out16) {
  (void)out16; /* only read with BF16 */
#ifdef BF16_LOOKUPS
  if (!out) {
    values_bf16(w, scale, offset, has_offset, elems, out16);
    return;
  }
#endif
  values_f32(w, scale, offset, has_offset, elems, out);
}

/* Where sub-block s (elements 32s..32s+31) of a block goes: float32 at out + 32s, or bfloat16 at out16 + s * stride. */
#define CHUNK(s) out ? out + QK * (s) : NULL, out ? NULL : out16 + (s) * stride

/* One block as float32 at out (elems contiguous values) or, where out is NULL, as bfloat16 at out16, 32 elements at
 * a time (elements 32s.. at out16 + s * stride). The formats of at most five bits look their codes up in the 32
 * values the block's scale gives (no unpacking into bytes, no conversion, multiply and add per 16 elements: a
 * permute per 16 or 32); Q8_0 and Q6_K are converted in explicit vectors. */
INLINE void block_values(const int64_t type, const uint8_t *b, float *out, uint16_t *out16, int64_t stride) {
  __m512 lo, hi;
  switch (type) {
    case Q4_0:
      value_pair(f16(b), 0.0f, 0, 8, &lo, &hi);
      lookup_codes(lo, hi, nibbles_v(b + 2), CHUNK(0));
      return;
    case Q4_1:
      value_pair(f16(b), f16(b + 2), 1, 0, &lo, &hi);
      lookup_codes(lo, hi, nibbles_v(b + 4), CHUNK(0));
      return;
    case Q5_0:
      value_pair(f16(b), 0.0f, 0, 16, &lo, &hi);
      lookup_codes(lo, hi, fives_v(b + 2, b + 6), CHUNK(0));
      return;
    case Q5_1:
      value_pair(f16(b), f16(b + 2), 1, 0, &lo, &hi);
      lookup_codes(lo, hi, fives_v(b + 4, b + 8), CHUNK(0));
      return;
    case Q8_0: { /* straight from the block: no copy of its bytes first */
      const float d = f16(b);
      values_to((const int8_t *)(b + 2), (const float[2]){d, d}, NULL, 0, QK, CHUNK(0));
      return;
    }
    case I4_G64:
    case I4_G128:
      value_pair(f16(b), f16(b + 2), 1, 0, &lo, &hi);
      for (int s = 0; s < (type == I4_G64 ? 2 : 4); s++) lookup_codes(lo, hi, nibbles_v(b + 4 + 16 * s), CHUNK(s));
      return;
    default:
      break;
  }
  int elems, bytes, has_offset;
  type_info(type, &elems, &bytes, &has_offset);
  int8_t w[QK_K];
  float scale[QK_K / 16], offset[QK_K / QK];
  unpack(type, b, w, scale, offset);
  for (int s = 0; s < elems / QK; s++) {
    if (type == Q4_K || type == Q5_K) { /* unsigned codes, a scale and a minimum per 32 */
      value_pair(scale[2 * s], offset[s], 1, 0, &lo, &hi);
      lookup_codes(lo, hi, _mm256_loadu_si256((const __m256i *)(w + QK * s)), CHUNK(s));
    } else {
      values_to(w + QK * s, scale + 2 * s, offset + s, has_offset, QK, CHUNK(s));
    }
  }
}
#undef CHUNK
#endif

/* Dequantize blocks i0..i1 of one type (a constant once inlined into the per-type functions below) into float32
 * dst, or into bfloat16 dst16 when dst is NULL: element 32c + j of block run i0.. (c counting from block 0) at
 * dst16 + c * stride + j, so that stride 32 is a plain row and a larger one scatters its 32-element runs (the
 * AMX panel's tiles). */
INLINE void dequantize_blocks(const int64_t type, const uint8_t *src, float *dst, uint16_t *dst16, int64_t stride,
                              int64_t i0, int64_t i1) {
  int elems, bytes, has_offset;
  type_info(type, &elems, &bytes, &has_offset);
  for (int64_t i = i0; i < i1; i++) {
#ifdef F32_LOOKUPS
#ifdef BF16_LOOKUPS
    const int vectors = 1;
#else
    const int vectors = dst != NULL; /* no AVX-512 BF16 rounding: bfloat16 goes the generic way below */
#endif
    if (vectors) {
      block_values(type, src + i * bytes, dst ? dst + i * elems : NULL, dst ? NULL : dst16 + i * (elems / QK) * stride,
                   stride);
      continue;
    }
#endif
    int8_t w[QK_K];
    float scale[QK_K / 16], offset[QK_K / QK];
    unpack(type, src + i * bytes, w, scale, offset);
    if (dst) {
      values_of(w, scale, offset, has_offset, elems, dst + i * elems);
    } else {
      float values[QK_K];
      values_of(w, scale, offset, has_offset, elems, values);
      const aliased_u32 *bits = (const aliased_u32 *)values;
      for (int j = 0; j < elems; j++) dst16[(i * elems + j) / QK * stride + j % QK] = bf16_bits(bits[j]);
    }
  }
}

#define DEQUANTIZE_FOR(T)                                                                                    \
  static void dequantize_##T(const uint8_t *s, float *d, uint16_t *d16, int64_t stride, int64_t i0, int64_t i1) { \
    dequantize_blocks(T, s, d, d16, stride, i0, i1);                                                          \
  }
DEQUANTIZE_FOR(Q4_0)
DEQUANTIZE_FOR(Q4_1)
DEQUANTIZE_FOR(Q5_0)
DEQUANTIZE_FOR(Q5_1)
DEQUANTIZE_FOR(Q8_0)
DEQUANTIZE_FOR(Q4_K)
DEQUANTIZE_FOR(Q5_K)
DEQUANTIZE_FOR(Q6_K)
DEQUANTIZE_FOR(I4_G64)
DEQUANTIZE_FOR(I4_G128)

typedef void (*dequantize_fn)(const uint8_t *, float *, uint16_t *, int64_t, int64_t, int64_t);

static dequantize_fn dequantize_for(int64_t type) {
  switch (type) {
    case Q4_0: return dequantize_Q4_0;
    case Q4_1: return dequantize_Q4_1;
    case Q5_0: return dequantize_Q5_0;
    case Q5_1: return dequantize_Q5_1;
    case Q8_0: return dequantize_Q8_0;
    case Q4_K: return dequantize_Q4_K;
    case Q5_K: return dequantize_Q5_K;
    case Q6_K: return dequantize_Q6_K;
    case I4_G64: return dequantize_I4_G64;
    case I4_G128: return dequantize_I4_G128;
    default: return NULL;
  }
}

/* Dequantize num_blocks blocks of `type` from src into dst: float32 (bf16 = 0) or bfloat16 (bf16 = 1), the
 * latter rounded to nearest even. 1 for an unknown type. */
int pagoda_quant_dequantize(int64_t type, const uint8_t *src, void *dst, int64_t bf16, int64_t num_blocks,
                            int64_t num_threads) {
  dequantize_fn run = dequantize_for(type);
  if (run == NULL) return 1;
  if (num_threads < 1 || num_blocks < 64) num_threads = 1;
  const int64_t chunk = 64, chunks = (num_blocks + chunk - 1) / chunk;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t c = 0; c < chunks; c++) {
    int64_t i0 = c * chunk, i1 = i0 + chunk < num_blocks ? i0 + chunk : num_blocks;
    run(src, bf16 ? NULL : (float *)dst, bf16 ? (uint16_t *)dst : NULL, QK, i0, i1);
  }
  return 0;
}

/* One 32-element sub-block of weights prepared for every row's dot product, and eight float lanes of sums:
 * acc_step adds lane l of the integer dot product w . x (its elements 4l..4l+3) times (scale lo for lanes 0-3,
 * hi for lanes 4-7) * dx. The lanes are exact integers on every path, and the float steps are the same. */
#if PATH >= 1
typedef __m256 facc;
typedef struct {
  __m256i a, b; /* VNNI: w and -128 * each lane's sum of w; AVX2: |w| (unsigned, 128 for -128) and w */
  __m256 s;     /* the scale of each lane */
} wprep;
INLINE wprep prepare_v(__m256i wv, float lo, float hi) {
  wprep p;
#if PATH == 2
  /* x is stored as q + 128 (unsigned): sum (q + 128) w - 128 sum w = sum q w, exactly */
  __m256i bias = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), wv);
  p.a = wv, p.b = _mm256_sub_epi32(_mm256_setzero_si256(), bias);
#else
  p.a = _mm256_abs_epi8(wv), p.b = wv;
#endif
  p.s = _mm256_setr_m128(_mm_set1_ps(lo), _mm_set1_ps(hi));
  return p;
}
INLINE wprep prepare(const int8_t *w, float lo, float hi) {
  return prepare_v(_mm256_loadu_si256((const __m256i *)w), lo, hi);
}
static inline facc acc_zero(void) { return _mm256_setzero_ps(); }
INLINE facc acc_step(facc acc, const wprep *p, const int8_t *x, float dx) {
  __m256i xv = _mm256_loadu_si256((const __m256i *)x);
#if PATH == 2
  __m256i lanes = _mm256_dpbusd_epi32(p->b, xv, p->a);
#else /* |w| * (x * sign(w)): |w| <= 128 and |x| <= 127, so the 16-bit pair sums never saturate */
  __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(p->a, _mm256_sign_epi8(xv, p->b)), _mm256_set1_epi16(1));
#endif
  __m256 s = _mm256_mul_ps(p->s, _mm256_set1_ps(dx));
  return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(lanes), s));
}
static inline void acc_store(facc acc, float out[8]) { _mm256_storeu_ps(out, acc); }
#else
typedef struct {
  float v[8];
} facc;
typedef struct {
  const int8_t *w;
  float lo, hi;
} wprep;
INLINE wprep prepare(const int8_t *w, float lo, float hi) {
  wprep p = {w, lo, hi};
  return p;
}
static inline facc acc_zero(void) {
  facc a;
  for (int l = 0; l < 8; l++) a.v[l] = 0.0f;
  return a;
}
INLINE facc acc_step(facc acc, const wprep *p, const int8_t *x, float dx) {
  for (int l = 0; l < 8; l++) {
    int32_t lane = 0;
    for (int i = 4 * l; i < 4 * l + 4; i++) lane += (int32_t)p->w[i] * (int32_t)x[i];
    acc.v[l] = acc.v[l] + (float)lane * ((l < 4 ? p->lo : p->hi) * dx);
  }
  return acc;
}
static inline void acc_store(facc acc, float out[8]) { memcpy(out, acc.v, sizeof acc.v); }
#endif

/* Row r of x as int8 per 32 elements: q = round(x / dx) with dx = max|x| / 127, and each block's sum of q
 * (stored as q + 128, unsigned, for the VNNI path's unsigned-by-signed products). x is float32, or bfloat16
 * (x_bf16) read exactly as the float32 it widens to. */
static void quantize_row(const void *xrow, int x_bf16, int64_t k, int8_t *q, float *dx, int32_t *qsum) {
#if PATH >= 1
  /* The same steps eight lanes at a time (a decode step quantizes ~3k elements per layer on both threads: the
   * scalar loop, with fmaxf a libm call, was ~0.3 ms of a 7 ms step): the maximum is exact in any order (a NaN
   * lane is skipped as fmaxf skips it: vmaxps returns its second operand, the running maximum, for a NaN), the
   * products are the same, vcvtps2dq rounds to nearest even as nearbyintf does (and gives INT_MIN for a NaN or an
   * overflow, as the scalar conversion does), and the sums are exact integers. */
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < k / QK; b++) {
    __m256 v[4];
    for (int i = 0; i < 4; i++) {
      if (x_bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)xrow + b * QK + 8 * i));
        v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      } else {
        v[i] = _mm256_loadu_ps((const float *)xrow + b * QK + 8 * i);
      }
    }
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4), d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    __m256i r[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
      r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
      r[i] = _mm256_max_epi32(_mm256_min_epi32(r[i], lim), nlim);
      sum = _mm256_add_epi32(sum, r[i]);
    }
    /* int32 -> int8 in element order: the packs interleave 128-bit halves, the permute restores the order */
    const __m256i p16 = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
    __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#if PATH == 2
    p8 = _mm256_xor_si256(p8, _mm256_set1_epi8((char)0x80));
#endif
    _mm256_storeu_si256((__m256i *)(q + b * QK), p8);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
    dx[b] = d;
    qsum[b] = _mm_cvtsi128_si32(s4);
  }
#else
  for (int64_t b = 0; b < k / QK; b++) {
    float v[QK];
    if (x_bf16) {
      const uint16_t *h = (const uint16_t *)xrow + b * QK;
      for (int i = 0; i < QK; i++) {
        uint32_t bits = (uint32_t)h[i] << 16;
        memcpy(&v[i], &bits, sizeof bits);
      }
    } else {
      memcpy(v, (const float *)xrow + b * QK, sizeof v);
    }
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
    float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < QK; i++) {
      int32_t r = (int32_t)nearbyintf(v[i] * inv);
      r = r > 127 ? 127 : r < -127 ? -127 : r;
#if PATH == 2
      q[b * QK + i] = (int8_t)(uint8_t)(r + 128);
#else
      q[b * QK + i] = (int8_t)r;
#endif
      sum += r;
    }
    dx[b] = d;
    qsum[b] = sum;
  }
#endif
}

/* y[index] = value, as float32 or rounded to bfloat16. */
INLINE void store_value(float value, void *y, int64_t index, int y_bf16) {
  if (y_bf16) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    ((uint16_t *)y)[index] = bf16_bits(bits);
  } else {
    ((float *)y)[index] = value;
  }
}

/* y[index] = the sum of acc's eight lanes (in lane order) plus off, as float32 or rounded to bfloat16. */
INLINE void store_output(facc acc, float off, void *y, int64_t index, int y_bf16) {
  float lanes[8], sum = 0.0f;
  acc_store(acc, lanes);
  for (int l = 0; l < 8; l++) sum = sum + lanes[l];
  store_value(sum + off, y, index, y_bf16);
}

#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4096
#endif
/* Software prefetch for the weight streams of the matmuls above: a thread's columns are runs of a few KB (a chunk
 * of the guided schedule), too short for the hardware prefetchers to ramp up, so a cold weight (every layer of a
 * decode step: the model is larger than the caches) streamed at about half the rate a cached one does. Each
 * column asks for the lines PREFETCH_AHEAD bytes past its own (prefetches never fault, past the end either);
 * measured on a Sapphire Rapids, one row from DRAM: a 4,096 x 640 Q5_0 gate/up 180 -> 137 us, the 262,144 x 640
 * Q8_0 LM head 12.5 -> 10.3 ms. */
INLINE void prefetch_ahead(const uint8_t *p, int64_t len) {
  for (int64_t at = 0; at < len; at += 64) __builtin_prefetch(p + PREFETCH_AHEAD + at, 0, 3);
}

/* The first PREFETCH_AHEAD bytes of a run, asked for at its start. */
INLINE void prefetch_start(const uint8_t *p) {
  for (int64_t at = 0; at < PREFETCH_AHEAD; at += 64) __builtin_prefetch(p + at, 0, 3);
}

/* Columns j0..j1 of y for one weight type (a constant once inlined into the per-type functions below). W is
 * unpacked 256 elements at a time (one super-block, or eight 32-blocks) and prepared once; then each row runs
 * over those eight sub-blocks with its sums in registers. */
INLINE void matmul_columns(const int64_t type, const uint8_t *weight, int64_t j0, int64_t j1, int64_t k,
                           const int8_t *xq, const float *xd, const int32_t *xs, int64_t rows, void *y,
                           int64_t y_stride, int y_bf16) {
  int elems, bytes, has_offset;
  type_info(type, &elems, &bytes, &has_offset);
  const int64_t xblocks = k / QK, wblocks = k / elems, row_bytes = wblocks * bytes;
  const int64_t per_chunk = QK_K / elems; /* weight blocks unpacked together */
  prefetch_start(weight + j0 * row_bytes);
  for (int64_t j = j0; j < j1; j++) {
    const uint8_t *wrow = weight + j * row_bytes;
    prefetch_ahead(wrow, row_bytes);
    for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
      int64_t nr = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
      facc acc[MAX_ROWS];
      float off[MAX_ROWS];
      for (int64_t r = 0; r < nr; r++) acc[r] = acc_zero(), off[r] = 0.0f;
      for (int64_t wb = 0; wb < wblocks; wb += per_chunk) {
        const int64_t nb = wblocks - wb < per_chunk ? wblocks - wb : per_chunk, nsub = nb * elems / QK;
        int8_t w[QK_K] __attribute__((aligned(32)));
        float scale[QK_K / 16], offset[QK_K / QK];
        wprep prep[QK_K / QK];
        for (int64_t b = 0; b < nb; b++)
          unpack(type, wrow + (wb + b) * bytes, w + b * elems, scale + b * elems / 16, offset + b * elems / QK);
        for (int64_t s = 0; s < nsub; s++) prep[s] = prepare(w + QK * s, scale[2 * s], scale[2 * s + 1]);
        for (int64_t r = 0; r < nr; r++) {
          const int64_t xb = (r0 + r) * xblocks + wb * elems / QK; /* this chunk's first block of x */
          facc a = acc[r];
          float o = off[r];
          for (int64_t s = 0; s < nsub; s++) {
            const float d = xd[xb + s];
            a = acc_step(a, &prep[s], xq + (xb + s) * QK, d);
            if (has_offset) o = o + offset[s] * d * (float)xs[xb + s];
          }
          acc[r] = a, off[r] = o;
        }
      }
      for (int64_t r = 0; r < nr; r++) store_output(acc[r], off[r], y, (r0 + r) * y_stride + j, y_bf16);
    }
  }
}

#if PATH >= 1
/* The 32 weights of one Q4_0 / Q5_1 block in a register, its scale and (Q5_1) its minimum: the bytes and floats
 * `unpack` writes. (Q4_1, Q5_0 and Q8_0 go four blocks at a time: cpu_quad.h.) */
INLINE __m256i block32(const int64_t type, const uint8_t *b, float *d, float *m) {
  *d = f16(b);
  if (type == Q4_0) return _mm256_sub_epi8(nibbles_v(b + 2), _mm256_set1_epi8(8));
  return *m = f16(b + 2), fives_v(b + 4, b + 8);
}

/* A one-row path's running sum of the minima's terms: matmul_columns' `o + offset * dx * qsum` for the formats
 * with a minimum (in block order, as there), nothing for the others. */
#define ONE_ROW_OFFSET(o, m, b) \
  if (has_offset) o = o + m * xd[b] * (float)xs[b]

/* The formats of the one-row register paths, and a call of ONE_ROW (defined by the caller) per format. */
#define ONE_ROW_TYPE(t) ((t) == Q4_0 || (t) == Q5_1)
#define ONE_ROW_DISPATCH(t)              \
  do {                                   \
    if ((t) == Q5_1) ONE_ROW(Q5_1);      \
    else ONE_ROW(Q4_0);                  \
  } while (0)

#if PATH == 2
/* One block of the row of x as the VNNI one-row path reads it: the signed q, and each lane's -128 times the sum
 * of its four q. Then vpdpbusd(bias, w + 128, q) is the lane's sum of q w exactly (w + 128 is w ^ 0x80 as an
 * unsigned byte), with no per-weight-block bias product (prepare_v's second vpdpbusd): x's corrections are made
 * once per row instead of once per weight block. */
typedef struct {
  __m256i q, bias;
} xblock;

static void prepare_x(const int8_t *xq, int64_t blocks, xblock *xb) {
  for (int64_t b = 0; b < blocks; b++) {
    /* xq holds q + 128 (quantize_row's VNNI form): flipping the top bit gives q */
    const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(xq + b * QK)), _mm256_set1_epi8((char)0x80));
    const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), q);
    xb[b].q = q;
    xb[b].bias = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 7));
  }
}

/* The float step of acc_step for a block whose two scales are one (d): d * dx is the lanes' common factor, the
 * same product prepare_v's scale vector times dx gives in every lane, so the same bits. */
INLINE __m256 one_row_step(__m256 acc, __m256i w, float d, const xblock *xb, float dx) {
  const __m256i lanes = _mm256_dpbusd_epi32(xb->bias, _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)), xb->q);
  return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(d * dx)));
}

/* x's block b as the VNNI one-row step reads it (a row's prepared form, `xrow_t` its element). */
typedef xblock xrow_t;
INLINE const xblock *x_at(const xrow_t *x, int64_t b) { return x + b; }
#else
/* acc_step on the AVX2 path for a block whose two scales are one (d): the same lanes (|w| times x with w's signs,
 * pair sums), and prepare_v's lane scale times dx is d * dx in every lane, so one broadcast of that product gives
 * the same bits as the prepared block did, without preparing it. */
INLINE __m256 one_row_step(__m256 acc, __m256i w, float d, __m256i xv, float dx) {
  const __m256i lanes =
      _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)), _mm256_set1_epi16(1));
  return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(d * dx)));
}

/* x's block b as the AVX2 one-row step reads it (the quantized row itself, `xrow_t` its element). */
typedef int8_t xrow_t;
INLINE __m256i x_at(const xrow_t *x, int64_t b) { return _mm256_loadu_si256((const __m256i *)(x + b * QK)); }
#endif

/* matmul_columns for one row of x (its one-row form: prepared blocks on the VNNI path, the quantized row on AVX2)
 * and a 32-element format (Q4_0, and Q5_1 with its minima's sums in the same order), every block kept
 * in registers (no unpack buffer, no prepared weight array): the same integer lanes and the same float steps in
 * the same order, so the same y, bit for bit. Two columns at a time (two independent sum chains, x's block read
 * once for both), the weights prefetched ahead. A decode step's matmuls are all one row, and the tied LM head
 * (Q8_0 in the default model's file, which took this path until the quad order) is most of the bytes a step
 * reads. Measured: on a Sapphire Rapids Xeon
 * (VNNI), the default model's Q8_0 LM head (262,144 x 640, 178 MB, two threads) 12.5 -> 7.4 ms, 24 GB/s, about
 * what two cores read there; on a 2-core AMD EPYC Zen 4 built for x86-64-v3 (AVX2), where that head, fused with
 * the draw, was 37% of a one-stream step (10.2 ms) and its per-block work set the pace, the step 9.0 -> 8.4-8.8 ms
 * (the AVX2 form had gone one column at a time, a prepared block each, without prefetching). */
INLINE void one_row_columns(const int64_t type, const uint8_t *weight, int64_t j0, int64_t j1, int64_t k,
                            const xrow_t *x, const float *xd, const int32_t *xs, void *y, int y_bf16) {
  int elems, bytes, has_offset;
  type_info(type, &elems, &bytes, &has_offset);
  const int64_t blocks = k / QK, row_bytes = blocks * bytes;
  int64_t j = j0;
  prefetch_start(weight + j0 * row_bytes);
  for (; j + 2 <= j1; j += 2) {
    const uint8_t *w0 = weight + j * row_bytes, *w1 = w0 + row_bytes;
    prefetch_ahead(w0, 2 * row_bytes);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    float o0 = 0.0f, o1 = 0.0f; /* without a minimum an offset sum of zero, as matmul_columns adds */
    for (int64_t b = 0; b < blocks; b++) {
      float d0, d1, m0 = 0.0f, m1 = 0.0f;
      const __m256i v0 = block32(type, w0 + b * bytes, &d0, &m0), v1 = block32(type, w1 + b * bytes, &d1, &m1);
      a0 = one_row_step(a0, v0, d0, x_at(x, b), xd[b]);
      a1 = one_row_step(a1, v1, d1, x_at(x, b), xd[b]);
      ONE_ROW_OFFSET(o0, m0, b);
      ONE_ROW_OFFSET(o1, m1, b);
    }
    store_output(a0, o0, y, j, y_bf16);
    store_output(a1, o1, y, j + 1, y_bf16);
  }
  for (; j < j1; j++) {
    const uint8_t *w0 = weight + j * row_bytes;
    __m256 a0 = _mm256_setzero_ps();
    float o0 = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
      float d0, m0 = 0.0f;
      const __m256i v0 = block32(type, w0 + b * bytes, &d0, &m0);
      a0 = one_row_step(a0, v0, d0, x_at(x, b), xd[b]);
      ONE_ROW_OFFSET(o0, m0, b);
    }
    store_output(a0, o0, y, j, y_bf16);
  }
}
#endif

#if PATH >= 1
/* Rows of one pass of the few-row path: R sums in registers (R ymm accumulators beside the block's three). */
#define FEW_ROWS 8

/* F(R) for the rows of the pass starting at r0 (at most pass <= FEW_ROWS), R a constant in each call so that F is
 * specialised per row count. */
#define FOR_PASS_ROWS(rows, r0, pass, F)                               \
  switch ((rows) - (r0) < (pass) ? (rows) - (r0) : (pass)) {           \
    case 1: F(1); break;                                               \
    case 2: F(2); break;                                               \
    case 3: F(3); break;                                               \
    case 4: F(4); break;                                               \
    case 5: F(5); break;                                               \
    case 6: F(6); break;                                               \
    case 7: F(7); break;                                               \
    default: F(8); break;                                              \
  }

/* Column j of y for rows r0 .. r0 + R of x (R a constant once inlined): each weight block decoded into a register
 * once (block32) and prepared once (prepare_v, as matmul_columns prepares its unpacked bytes), then every row's
 * acc_step on it, and the minima's terms in block order: the same lanes and float steps as matmul_columns. */
INLINE __attribute__((always_inline)) void few_rows_column(const int R, const int64_t type, const uint8_t *wrow,
                                                           int64_t blocks, int bytes, int has_offset, const int8_t *xq,
                                                           const float *xd, const int32_t *xs, int64_t r0, void *y,
                                                           int64_t index, int64_t y_stride, int y_bf16) {
  facc acc[FEW_ROWS];
  float off[FEW_ROWS];
  for (int r = 0; r < R; r++) acc[r] = acc_zero(), off[r] = 0.0f;
  for (int64_t b = 0; b < blocks; b++) {
    float d, m = 0.0f;
    const __m256i w = block32(type, wrow + b * bytes, &d, &m); /* sets d first: not inside prepare_v's arguments */
    const wprep p = prepare_v(w, d, d);
    for (int r = 0; r < R; r++) {
      const int64_t xb = (r0 + r) * blocks + b;
      acc[r] = acc_step(acc[r], &p, xq + xb * QK, xd[xb]);
      if (has_offset) off[r] = off[r] + m * xd[xb] * (float)xs[xb];
    }
  }
  for (int r = 0; r < R; r++) store_output(acc[r], off[r], y, (r0 + r) * y_stride + index, y_bf16);
}

/* matmul_columns for two or more rows of a 32-element format (Q4_0, Q5_1), the weights decoded in
 * registers instead of unpacked to memory 256 at a time: the same y, bit for bit. Why: a speculative step (a token
 * and its drafts) or a few decode rows multiply every weight by a handful of rows, and matmul_columns' unpacking
 * cost those steps ~2.7x a one-row step (measured on Q4_1 layers, 2-core Zen 4, before Q4_1 took the quad order). */
INLINE void few_rows_columns(const int64_t type, const uint8_t *weight, int64_t j0, int64_t j1, int64_t k,
                             const int8_t *xq, const float *xd, const int32_t *xs, int64_t rows, void *y,
                             int64_t y_stride, int y_bf16) {
  int elems, bytes, has_offset;
  type_info(type, &elems, &bytes, &has_offset);
  const int64_t blocks = k / QK, row_bytes = blocks * bytes;
  prefetch_start(weight + j0 * row_bytes);
  for (int64_t j = j0; j < j1; j++) {
    const uint8_t *wrow = weight + j * row_bytes;
    prefetch_ahead(wrow, row_bytes);
    for (int64_t r0 = 0; r0 < rows; r0 += FEW_ROWS) {
#define FEW(R) few_rows_column(R, type, wrow, blocks, bytes, has_offset, xq, xd, xs, r0, y, j, y_stride, y_bf16)
      FOR_PASS_ROWS(rows, r0, FEW_ROWS, FEW)
#undef FEW
    }
  }
}
#endif

#include "cpu_quad.h"
#include "cpu_rows16.h"

/* Rows of x (x_stride elements apart, float32 or bfloat16) quantized for the GEMV: quantize_row's q, dx and qsum
 * (rows k, k / QK apart), and where xg is not NULL each row's quad form (quad_groups(k) apart). */
static void quantize_rows(const void *x, int64_t x_stride, int x_bf16, int64_t rows, int64_t k, int8_t *xq,
                          float *xd, int32_t *xs, xquad *xg) {
  const size_t x_size = x_bf16 ? sizeof(uint16_t) : sizeof(float);
  const int64_t xblocks = k / QK;
  /* each row on its own: a prompt's thousands of rows in parallel (one thread took ~10% of a 2,048-row GEMV) */
#pragma omp parallel for schedule(static) if (rows * k >= (1 << 16))
  for (int64_t r = 0; r < rows; r++) {
    quantize_row((const char *)x + (size_t)(r * x_stride) * x_size, x_bf16, k, xq + r * k, xd + r * xblocks,
                 xs + r * xblocks);
    if (xg) prepare_quad(xq + r * k, xd + r * xblocks, xs + r * xblocks, k, xg + r * quad_groups(k));
  }
}

/* Columns of one format for any rows: the quad order for its formats (x in quad form: xg), else the few-row
 * register path where it takes the format, else matmul_columns. */
INLINE void any_rows_columns(const int64_t type, const uint8_t *w, int64_t j0, int64_t j1, int64_t k, const int8_t *xq,
                             const float *xd, const int32_t *xs, const xquad *xg, int64_t rows, void *y,
                             int64_t y_stride, int y_bf16) {
  if (QUAD_TYPE(type)) {
    /* Blocks of MAX_ROWS rows, each over the chunk's columns: past 16 rows x's quad form no longer stays in L1
     * while a column sweeps it (the 262k-row Q8_0 head at 24 rows 2.6x its time at 16, then 1.6x). */
    for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS)
      quad_columns(type, w, j0, j1, k, xg + r0 * quad_groups(k), rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS,
                   y_row(y, r0, y_stride, y_bf16), y_stride, y_bf16);
    return;
  }
#if PATH >= 1
  if (rows > 1 && ONE_ROW_TYPE(type)) {
    few_rows_columns(type, w, j0, j1, k, xq, xd, xs, rows, y, y_stride, y_bf16);
    return;
  }
#endif
  matmul_columns(type, w, j0, j1, k, xq, xd, xs, rows, y, y_stride, y_bf16);
}

#define COLUMNS_FOR(T)                                                                                           \
  static void columns_##T(const uint8_t *w, int64_t j0, int64_t j1, int64_t k, const int8_t *xq, const float *xd, \
                          const int32_t *xs, const xquad *xg, int64_t rows, void *y, int64_t y_stride,          \
                          int y_bf16) {                                                                          \
    any_rows_columns(T, w, j0, j1, k, xq, xd, xs, xg, rows, y, y_stride, y_bf16);                              \
  }
COLUMNS_FOR(Q4_0)
COLUMNS_FOR(Q4_1)
COLUMNS_FOR(Q5_0)
COLUMNS_FOR(Q5_1)
COLUMNS_FOR(Q8_0)
COLUMNS_FOR(Q4_K)
COLUMNS_FOR(Q5_K)
COLUMNS_FOR(Q6_K)
COLUMNS_FOR(I4_G64)
COLUMNS_FOR(I4_G128)

typedef void (*columns_fn)(const uint8_t *, int64_t, int64_t, int64_t, const int8_t *, const float *,
                           const int32_t *, const xquad *, int64_t, void *, int64_t, int);

static columns_fn columns_for(int64_t type) {
  switch (type) {
    case Q4_0: return columns_Q4_0;
    case Q4_1: return columns_Q4_1;
    case Q5_0: return columns_Q5_0;
    case Q5_1: return columns_Q5_1;
    case Q8_0: return columns_Q8_0;
    case Q4_K: return columns_Q4_K;
    case Q5_K: return columns_Q5_K;
    case Q6_K: return columns_Q6_K;
    case I4_G64: return columns_I4_G64;
    case I4_G128: return columns_I4_G128;
    case Q8_0_R16: return columns_Q8_0_R16;
    case Q4_1_R16: return columns_Q4_1_R16;
    case Q5_0_R16: return columns_Q5_0_R16;
    case Q4_K_R16: return columns_Q4_K_R16;
    case Q6_K_R16: return columns_Q6_K_R16;
    default: return NULL;
  }
}

/* y[r, j] = sum_i x[r, i] * W[j, i] for W [n, k] of `type` (rows of bytes k / elems * bytes). x rows are
 * x_stride elements apart, y rows y_stride; x is float32 or bfloat16 (x_bf16), y float32 or bfloat16 (y_bf16:
 * the float32 result rounded to nearest even, as torch converts), so bfloat16 activations need no copies.
 * 0 on success, 1 for an unknown type or k not a multiple of the block, 2 when the work space cannot be allocated. */
int pagoda_quant_matmul(int64_t type, const uint8_t *weight, int64_t n, int64_t k, const void *x, int64_t x_stride,
                        int64_t x_bf16, int64_t rows, void *y, int64_t y_stride, int64_t y_bf16,
                        int64_t num_threads) {
  int elems, bytes, has_offset;
  type_info(type, &elems, &bytes, &has_offset);
  columns_fn columns = columns_for(type);
  if (columns == NULL || k % elems != 0) return 1;
  if (rows == 0 || n == 0) return 0;
  const int64_t xblocks = k / QK;
  int8_t *xq = malloc((size_t)(rows * k));
  float *xd = malloc(sizeof(float) * (size_t)(rows * xblocks));
  int32_t *xs = malloc(sizeof(int32_t) * (size_t)(rows * xblocks));
  const int64_t groups = QUAD_TYPE(type) ? quad_groups(k) : 0; /* x's quad form only for a quad-order weight */
  xquad *xg = groups ? aligned_alloc(64, sizeof(xquad) * (size_t)(rows * groups)) : NULL;
  if (!xq || !xd || !xs || (groups && !xg)) {
    free(xq), free(xd), free(xs), free(xg);
    return 2;
  }
  quantize_rows(x, x_stride, (int)x_bf16, rows, k, xq, xd, xs, xg);
  if (R16_SIGNED_X(type)) r16_signed_x(xq, xq, rows * k);
  if (num_threads < 1 || n * k < (1 << 16)) num_threads = 1; /* waking threads would cost more */
  /* Chunks of 64 contiguous columns (43 KB of a Q8_0 LM head), handed out guided: each thread first takes long
   * contiguous runs (what the prefetchers stream best: a dynamic schedule's interleaved chunks made the LM head
   * 8 -> 12 ms), then ever smaller ones, so a thread the OS deschedules for a while (the server's event loop
   * shares the two cores) holds up a small chunk, not half the matrix as a static split would. Each output is
   * still computed whole by one thread. */
  const int64_t chunk = 64, chunks = (n + chunk - 1) / chunk;
#if PATH >= 1
  if (rows == 1 && ONE_ROW_TYPE(type)) {
#if PATH == 2
    xblock *xb = aligned_alloc(32, sizeof(xblock) * (size_t)xblocks);
    if (!xb) {
      free(xq), free(xd), free(xs), free(xg);
      return 2;
    }
    prepare_x(xq, xblocks, xb);
#define ONE_ROW(T) one_row_columns(T, weight, j0, j1, k, xb, xd, xs, y, (int)y_bf16)
#else
#define ONE_ROW(T) one_row_columns(T, weight, j0, j1, k, xq, xd, xs, y, (int)y_bf16)
#endif
#pragma omp parallel for num_threads(num_threads) schedule(guided)
    for (int64_t c = 0; c < chunks; c++) {
      int64_t j0 = c * chunk, j1 = j0 + chunk < n ? j0 + chunk : n;
      ONE_ROW_DISPATCH(type); /* constant types: each call is specialised when inlined */
    }
#undef ONE_ROW
#if PATH == 2
    free(xb);
#endif
    free(xq), free(xd), free(xs), free(xg);
    return 0;
  }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(guided)
  for (int64_t c = 0; c < chunks; c++) {
    int64_t j0 = c * chunk, j1 = j0 + chunk < n ? j0 + chunk : n;
    columns(weight, j0, j1, k, xq, xd, xs, xg, rows, y, y_stride, (int)y_bf16);
  }
  free(xq), free(xd), free(xs), free(xg);
  return 0;
}

/* This thread's slice of a work space cut into per_thread bytes a thread (inside a parallel region). */
static inline char *thread_share(char *work, size_t per_thread) {
#ifdef _OPENMP
  return work + per_thread * (size_t)omp_get_thread_num();
#else
  (void)per_thread;
  return work;
#endif
}

/* Many rows on the vector unit (every build): y = x @ W^T in float32, for float32 x (or bfloat16, widened
 * exactly), W dequantized to float32 (bit-exact) FMA_PANEL rows at a time into a panel that stays in L2, so each
 * weight byte is read once per group of rows and no dense copy of W exists. x is laid out once per call in blocks
 * of FMA_MT rows, k-major ([k][FMA_MT]: two vector loads per k cover the block). Each micro tile, FMA_MT rows of x
 * by FMA_NR columns of y, is summed over the whole of k in registers: per k, two loads of x and FMA_NR broadcasts
 * of W feed 2 * FMA_NR fused multiply-adds (AVX-512: 32 x 12 in 24 accumulators; AVX2 with FMA: 16 x 6 in 12;
 * generic C: 8 x 4 of 4-lane vectors, multiply then add). A tile's W (FMA_NR rows) stays in L1 while every block
 * of the group streams past it from L2; the rows of x are taken in groups whose layout fits in L2 (FMA_X_BYTES),
 * each group running over every panel. Summation is in k order, per output: y does not depend on the thread count;
 * against the dense float32 matmul only the order (and, on the vector paths, the fused rounding) differs. */
#if defined(__AVX512F__)
#define FMA_VW 16
#define FMA_NR 12
#elif defined(__AVX2__) && defined(__FMA__)
#define FMA_VW 8
#define FMA_NR 6
#else
#define FMA_VW 4
#define FMA_NR 4
#endif
#define FMA_XV 2                 /* vectors of x per micro tile (3 x 8, 4 x 6 and 2 x 14 were slower) */
#define FMA_MT (FMA_XV * FMA_VW) /* rows of x per block and micro tile */
#define FMA_PANEL (4 * FMA_NR) /* rows of W per dequantized panel */
#ifndef FMA_X_BYTES
#define FMA_X_BYTES (1 << 20)
#endif
#ifndef FMA_KC
#define FMA_KC 256 /* k per run: a tile's W (FMA_NR x FMA_KC floats) stays in L1 while x's blocks stream past */
#endif

typedef float fvec __attribute__((vector_size(4 * FMA_VW)));

INLINE fvec fvec_fma(fvec a, fvec b, fvec c) {
#if FMA_VW == 16
  return (fvec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif FMA_VW == 8
  return (fvec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

/* every lane = *p (a broadcast from memory: a load, not a shuffle competing with the multiply-adds' port) */
INLINE fvec fvec_splat(const float *p) {
#if FMA_VW == 16
  return (fvec)_mm512_set1_ps(*p);
#elif FMA_VW == 8
  return (fvec)_mm256_set1_ps(*p);
#else
  return (fvec){*p, *p, *p, *p};
#endif
}

/* Block mb of x's layout: rows mb * FMA_MT.. of x [rows, k] (float32, or bfloat16 by x_bf16; x_stride elements a
 * row) as dst[kk * FMA_MT + m]; the rows past `rows` are zero. Written 16 values of k at a time for every row, so
 * that the 16 lines being written stay in L1 (row by row, each store would touch a new line of the block). */
static void fma_pack(const void *x, int64_t x_stride, int x_bf16, int64_t rows, int64_t mb, int64_t k, float *dst) {
  for (int64_t k0 = 0; k0 < k; k0 += 16) {
    const int64_t k1 = k0 + 16 < k ? k0 + 16 : k;
    for (int64_t m = 0; m < FMA_MT; m++) {
      const int64_t r = mb * FMA_MT + m;
      if (r >= rows) {
        for (int64_t kk = k0; kk < k1; kk++) dst[kk * FMA_MT + m] = 0.0f;
      } else if (x_bf16) {
        const uint16_t *src = (const uint16_t *)x + r * x_stride;
        for (int64_t kk = k0; kk < k1; kk++) {
          const uint32_t bits = (uint32_t)src[kk] << 16;
          memcpy(dst + kk * FMA_MT + m, &bits, sizeof bits);
        }
      } else {
        const float *src = (const float *)x + r * x_stride;
        for (int64_t kk = k0; kk < k1; kk++) dst[kk * FMA_MT + m] = src[kk];
      }
    }
  }
}

/* c[i * FMA_MT + m] (+)= sum over kk < kc of xp[kk * FMA_MT + m] * w[i * ldw + kk], for FMA_NR rows of W at w
 * (ldw apart): the first run of k starts from zero, the others add to c. */
INLINE void fma_tile(const float *restrict xp, const float *restrict w, int64_t kc, int64_t ldw, int first,
                     float *restrict c) {
  fvec acc[FMA_NR][FMA_XV];
#pragma GCC unroll 16
  for (int i = 0; i < FMA_NR; i++) {
#pragma GCC unroll 4
    for (int v = 0; v < FMA_XV; v++) {
      if (first) acc[i][v] = (fvec){0};
      else memcpy(&acc[i][v], c + i * FMA_MT + v * FMA_VW, sizeof acc[i][v]);
    }
  }
  for (int64_t kk = 0; kk < kc; kk++) {
    fvec xv[FMA_XV];
#pragma GCC unroll 4
    for (int v = 0; v < FMA_XV; v++) memcpy(&xv[v], xp + kk * FMA_MT + v * FMA_VW, sizeof xv[v]);
#pragma GCC unroll 16
    for (int i = 0; i < FMA_NR; i++) {
      const fvec b = fvec_splat(w + i * ldw + kk);
#pragma GCC unroll 4
      for (int v = 0; v < FMA_XV; v++) acc[i][v] = fvec_fma(xv[v], b, acc[i][v]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < FMA_NR; i++) {
#pragma GCC unroll 4
    for (int v = 0; v < FMA_XV; v++) memcpy(c + i * FMA_MT + v * FMA_VW, &acc[i][v], sizeof acc[i][v]);
  }
}

/* y[m0 + m, j0 + i] = c[i * FMA_MT + m] for the tile's valid rows and columns (bfloat16: rounded as torch). */
static void fma_store(const float *c, int64_t rows, int64_t cols, void *y, int64_t y_stride, int y_bf16, int64_t m0,
                      int64_t j0) {
  for (int64_t m = 0; m < rows; m++) {
    if (y_bf16) {
      uint16_t *out = (uint16_t *)y + (m0 + m) * y_stride + j0;
      for (int64_t i = 0; i < cols; i++) {
        uint32_t bits;
        memcpy(&bits, c + i * FMA_MT + m, sizeof bits);
        out[i] = bf16_bits(bits);
      }
    } else {
      float *out = (float *)y + (m0 + m) * y_stride + j0;
      for (int64_t i = 0; i < cols; i++) out[i] = c[i * FMA_MT + m];
    }
  }
}

#ifdef BF16_LOOKUPS
#define FMA_DP 1 /* pagoda_quant_matmul_dpbf16 is built */
/* Block mb of x's pair layout for the bfloat16 dot products: dst[kp * FMA_MT + m] = the pair x[r, 2kp],
 * x[r, 2kp + 1] of row r = mb * FMA_MT + m (bfloat16 x; zero past `rows`), 16 pairs at a time as fma_pack. */
static void dp_pack(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t mb, int64_t pairs, uint32_t *dst) {
  for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
    const int64_t p1 = p0 + 16 < pairs ? p0 + 16 : pairs;
    for (int64_t m = 0; m < FMA_MT; m++) {
      const int64_t r = mb * FMA_MT + m;
      for (int64_t kp = p0; kp < p1; kp++) {
        uint32_t pair = 0;
        if (r < rows) memcpy(&pair, x + r * x_stride + 2 * kp, sizeof pair);
        dst[kp * FMA_MT + m] = pair;
      }
    }
  }
}

/* fma_tile with bfloat16 pairs: c (+)= sum over kp < kc of the pair products of xp[kp * FMA_MT + m] and the pair
 * w[i * ldw + kp] of W's row i, by vdpbf16ps (two exact products a lane, summed in float32). */
INLINE void dp_tile(const uint32_t *restrict xp, const uint32_t *restrict w, int64_t kc, int64_t ldw, int first,
                    float *restrict c) {
  __m512 acc[FMA_NR][FMA_XV];
#pragma GCC unroll 16
  for (int i = 0; i < FMA_NR; i++) {
#pragma GCC unroll 4
    for (int v = 0; v < FMA_XV; v++)
      acc[i][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * FMA_MT + v * FMA_VW);
  }
  for (int64_t kp = 0; kp < kc; kp++) {
    __m512i xv[FMA_XV];
#pragma GCC unroll 4
    for (int v = 0; v < FMA_XV; v++) xv[v] = _mm512_loadu_si512(xp + kp * FMA_MT + v * FMA_VW);
#pragma GCC unroll 16
    for (int i = 0; i < FMA_NR; i++) {
      const __m512i b = _mm512_set1_epi32((int)w[i * ldw + kp]);
#pragma GCC unroll 4
      for (int v = 0; v < FMA_XV; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)xv[v], (__m512bh)b);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < FMA_NR; i++) {
#pragma GCC unroll 4
    for (int v = 0; v < FMA_XV; v++) _mm512_storeu_ps(c + i * FMA_MT + v * FMA_VW, acc[i][v]);
  }
}
#endif

/* x's row block mb laid out for vector_panel: dp = 0 in floats (fma_pack), dp = 1 in bfloat16 pairs (dp_pack;
 * bfloat16 x). */
static void vector_pack(const void *x, int64_t x_stride, int x_bf16, int64_t rows, int64_t mb, int64_t k, int dp,
                        uint32_t *dst) {
#ifdef FMA_DP
  if (dp) {
    dp_pack((const uint16_t *)x, x_stride, rows, mb, k / 2, dst);
    return;
  }
#endif
  (void)dp;
  fma_pack(x, x_stride, x_bf16, rows, mb, k, (float *)dst);
}

/* Columns j0 .. j0 + cols (cols <= FMA_PANEL) of y = x W^T for x's row blocks g0 .. g1, laid out by vector_pack
 * at xp (block g0 first): the panel's W rows dequantized into `panel` (FMA_PANEL * slots 4-byte slots), summed
 * over k per micro tile in `acc` (FMA_PANEL * FMA_MT floats per block), stored into y. dp as vector_pack's. Each
 * output is its x row's and W row's sum in k order, whatever the panel, the blocks or the thread. */
static void vector_panel(dequantize_fn deq, int elems, const uint8_t *weight, int64_t row_bytes, int64_t k, int dp,
                         int64_t j0, int64_t cols, const uint32_t *xp, int64_t g0, int64_t g1, int64_t rows,
                         uint32_t *panel, float *acc, void *y, int64_t y_stride, int y_bf16) {
  const int64_t slots = dp ? k / 2 : k;
  for (int64_t r = 0; r < cols; r++) {
    const uint8_t *src = weight + (j0 + r) * row_bytes;
    prefetch_ahead(src, row_bytes); /* as in the AMX matmul */
    if (dp) deq(src, NULL, (uint16_t *)(panel + r * slots), QK, 0, k / elems);
    else deq(src, (float *)(panel + r * slots), NULL, QK, 0, k / elems);
  }
  /* a last tile's missing rows: zeros, so that its unused lanes stay finite */
  memset(panel + cols * slots, 0, 4 * (size_t)(((cols + FMA_NR - 1) / FMA_NR * FMA_NR - cols) * slots));
  for (int64_t k0 = 0; k0 < slots; k0 += FMA_KC) {
    const int64_t kc = slots - k0 < FMA_KC ? slots - k0 : FMA_KC;
    for (int64_t t0 = 0; t0 < cols; t0 += FMA_NR) {
      for (int64_t mb = g0; mb < g1; mb++) {
        float *c = acc + ((mb - g0) * FMA_PANEL + t0) * FMA_MT;
        const uint32_t *xs = xp + ((mb - g0) * slots + k0) * FMA_MT, *ws = panel + t0 * slots + k0;
#ifdef FMA_DP
        if (dp) dp_tile(xs, ws, kc, slots, k0 == 0, c);
        else
#endif
          fma_tile((const float *)xs, (const float *)ws, kc, slots, k0 == 0, c);
        if (k0 + kc < slots) continue;
        const int64_t tr = rows - mb * FMA_MT < FMA_MT ? rows - mb * FMA_MT : FMA_MT;
        const int64_t tc = cols - t0 < FMA_NR ? cols - t0 : FMA_NR;
        fma_store(c, tr, tc, y, y_stride, y_bf16, mb * FMA_MT, j0 + t0);
      }
    }
  }
}

/* The driver of both vector-unit matmuls: dp = 0 multiplies in float32 (fma_pack, fma_tile: k slots of one
 * float), dp = 1 in bfloat16 pairs (dp_pack, dp_tile: k / 2 slots of one pair). Every buffer counts 4-byte slots. */
static int vector_matmul(int64_t type, const uint8_t *weight, int64_t n, int64_t k, const void *x, int64_t x_stride,
                         int64_t x_bf16, int64_t rows, void *y, int64_t y_stride, int64_t y_bf16,
                         int64_t num_threads, int dp) {
  int elems, bytes, has_offset;
  type_info(type, &elems, &bytes, &has_offset);
  dequantize_fn deq = dequantize_for(type);
  if (deq == NULL || k % elems != 0 || (dp && (!x_bf16 || k % 2 != 0))) return 1;
  if (rows == 0 || n == 0) return 0;
  const int64_t slots = dp ? k / 2 : k; /* per row of x or W */
  const int64_t blocks = (rows + FMA_MT - 1) / FMA_MT, row_bytes = k / elems * bytes;
  const int64_t panels = (n + FMA_PANEL - 1) / FMA_PANEL;
  int64_t group = FMA_X_BYTES / (slots * 4 * FMA_MT);
  if (group < 1) group = 1;
  if (group > blocks) group = blocks;
  if (num_threads < 1 || panels < 2) num_threads = 1;
  /* per thread: the panel, then the sums of a group's tiles between runs of k */
  const size_t acc_at = (4 * (size_t)(FMA_PANEL * slots) + 63) / 64 * 64;
  const size_t per_thread = acc_at + sizeof(float) * (size_t)(group * FMA_PANEL * FMA_MT);
  uint32_t *xp = aligned_alloc(64, 4 * (size_t)(group * FMA_MT * slots)); /* one group's blocks */
  char *work = aligned_alloc(64, per_thread * (size_t)num_threads);
  if (!xp || !work) {
    free(xp), free(work);
    return 2;
  }
#pragma omp parallel num_threads(num_threads)
  {
    char *mine = thread_share(work, per_thread);
    uint32_t *panel = (uint32_t *)mine;
    float *acc = (float *)(mine + acc_at);
    for (int64_t g0 = 0; g0 < blocks; g0 += group) {
      const int64_t g1 = g0 + group < blocks ? g0 + group : blocks;
      /* laid out just before use, so that it is still in L2 (the loop below waits for every block) */
#pragma omp for schedule(static)
      for (int64_t mb = g0; mb < g1; mb++)
        vector_pack(x, x_stride, (int)x_bf16, rows, mb, k, dp, xp + (mb - g0) * slots * FMA_MT);
#pragma omp for schedule(guided)
      for (int64_t p = 0; p < panels; p++) {
        const int64_t j0 = p * FMA_PANEL, cols = n - j0 < FMA_PANEL ? n - j0 : FMA_PANEL;
        vector_panel(deq, elems, weight, row_bytes, k, dp, j0, cols, xp, g0, g1, rows, panel, acc, y, y_stride,
                     (int)y_bf16);
      }
    }
  }
  free(work);
  free(xp);
  return 0;
}

/* y [rows, n] = x [rows, k] @ W^T on the vector unit in float32 (x float32, or bfloat16 widened exactly), the
 * arguments of pagoda_quant_matmul. 0 on success, 1 for an unknown type or k not a multiple of the block, 2 when
 * memory cannot be had. */
int pagoda_quant_matmul_fma(int64_t type, const uint8_t *weight, int64_t n, int64_t k, const void *x,
                            int64_t x_stride, int64_t x_bf16, int64_t rows, void *y, int64_t y_stride,
                            int64_t y_bf16, int64_t num_threads) {
  return vector_matmul(type, weight, n, k, x, x_stride, x_bf16, rows, y, y_stride, y_bf16, num_threads, 0);
}

#ifdef FMA_DP
/* The same with bfloat16 x and W dequantized to bfloat16 (rounded to nearest even), multiplied by AVX-512 BF16's
 * pair dot products (the numerics of a dense bfloat16 matmul on such a CPU: products exact, sums in float32; the
 * instruction flushes subnormals). 1 also for a float32 x. */
int pagoda_quant_matmul_dpbf16(int64_t type, const uint8_t *weight, int64_t n, int64_t k, const void *x,
                               int64_t x_stride, int64_t x_bf16, int64_t rows, void *y, int64_t y_stride,
                               int64_t y_bf16, int64_t num_threads) {
  return vector_matmul(type, weight, n, k, x, x_stride, x_bf16, rows, y, y_stride, y_bf16, num_threads, 1);
}
#endif

/* Many rows on AMX (built where the target has AMX-TILE and AMX-BF16): y = x @ W^T with bfloat16 x, W dequantized
 * 32 rows at a time into a bfloat16 panel that stays in L1/L2 and fed to the tile unit, so each weight byte is
 * read once per call and no dense copy of W exists. The weight panel is the A operand (16 rows of W by 32 k per
 * tile, read straight from the panel); x is the B operand, laid out once per call as pairs of k (row kp, column m:
 * x[m, 2kp], x[m, 2kp + 1]); each C tile is 16 columns of y by 16 rows of x. The products are exact in float32
 * and summed in float32 by the tile unit (its order, not the reference's: the bfloat16 dense path's numerics). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_PANEL 32 /* rows of W per panel: two A tiles */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* 1 when the tile unit may be used by this process (Linux grants the tile data state on request), else 0. */
int pagoda_quant_amx(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* r[i] = column i of the 16 x 16 row-major float matrix c (unpacks, then in-lane and cross-lane shuffles). */
static inline void transpose16(const float *c, __m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(c + 16 * i);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; i++) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

/* y[m0 + m, j0 + i] = lo[i, m] and y[m0 + m, j0 + 16 + i] = hi[i, m] for the valid rows and columns of two
 * 16 x 16 float32 C tiles (columns of y by rows of x): transposed in registers and stored a row at a time, both
 * halves together (one whole 64-byte line of a bfloat16 y), under a mask, rounded to bfloat16 as torch rounds. */
static inline void store_tiles(const float *lo, const float *hi, int64_t rows, int64_t cols, void *y,
                               int64_t y_stride, int y_bf16, int64_t m0, int64_t j0) {
  __m512 a[16], b[16];
  transpose16(lo, a);
  if (cols > 16) transpose16(hi, b);
  const __mmask16 mlo = (__mmask16)(cols >= 16 ? 0xFFFF : (1u << cols) - 1u);
  const __mmask16 mhi = (__mmask16)(cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1u);
  for (int64_t m = 0; m < rows; m++) {
    if (y_bf16) {
      uint16_t *out = (uint16_t *)y + (m0 + m) * y_stride + j0;
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(cols > 16 ? b[m] : a[m], a[m]);
      _mm512_mask_storeu_epi16(out, (__mmask32)mlo | (__mmask32)mhi << 16, both);
    } else {
      float *out = (float *)y + (m0 + m) * y_stride + j0;
      _mm512_mask_storeu_ps(out, mlo, a[m]);
      if (mhi) _mm512_mask_storeu_ps(out + 16, mhi, b[m]);
    }
  }
}

/* Both operands are laid out tile by tile, so that every tile load reads 1 KB of consecutive lines (rows a power
 * of two apart would share an L1 set). B: 16 rows of x a block, each block k / 2 pairs of 16 words (the pair of
 * x[m, 2kp], x[m, 2kp + 1]); A: the panel's two halves of 16 rows of W, each k / 32 tiles of 16 rows x 32 values.
 * Blocking, for the caches: the rows of x are taken in blocks whose B stays in L2 (AMX_B_BYTES); each block of rows
 * runs over every panel (a panel is dequantized once per block of rows: once in all for a decode batch); and k is
 * cut in runs of at most AMX_K_CHUNKS tiles, so that the run's A (16 KB) stays in L1 while the block's B streams
 * past it, the C tiles parked between runs in a float32 buffer. */
#ifndef AMX_B_BYTES
#define AMX_B_BYTES (1 << 20)
#endif
#ifndef AMX_K_CHUNKS
#define AMX_K_CHUNKS 8
#endif

/* Block mb (16 rows) of the tile-blocked B of x [rows, k] (bfloat16, x_stride), see above: each 16 x 16 square of
 * pairs transposed in registers; the rows past `rows` are zero. */
static void amx_b_block(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t mb, int64_t pairs, uint32_t *xt) {
  uint32_t *dst = xt + mb * pairs * 16;
  float square[256] __attribute__((aligned(64)));
  for (int64_t kp0 = 0; kp0 < pairs; kp0 += 16) {
    for (int64_t i = 0; i < 16; i++) {
      const int64_t m = mb * 16 + i;
      __m512 v = m < rows ? _mm512_loadu_ps((const float *)(x + m * x_stride + 2 * kp0)) : _mm512_setzero_ps();
      _mm512_store_ps(square + 16 * i, v);
    }
    __m512 t[16];
    transpose16(square, t);
    for (int64_t j = 0; j < 16; j++) _mm512_storeu_ps((float *)(dst + (kp0 + j) * 16), t[j]);
  }
}

/* y [rows, n] (y_stride elements a row; float32 or bfloat16 by y_bf16) = x [rows, k] (x_stride) @ W^T, the
 * arguments of pagoda_quant_matmul; x must be bfloat16 (x_bf16 = 1). 0 on success, 1 for a float32 x, an unknown
 * type or k not a multiple of 32 and the block, 2 when memory cannot be had. */
int pagoda_quant_matmul_amx(int64_t type, const uint8_t *weight, int64_t n, int64_t k, const uint16_t *x,
                            int64_t x_stride, int64_t x_bf16, int64_t rows, void *y, int64_t y_stride,
                            int64_t y_bf16, int64_t num_threads) {
  int elems, bytes, has_offset;
  type_info(type, &elems, &bytes, &has_offset);
  dequantize_fn deq = dequantize_for(type);
  if (!x_bf16 || deq == NULL || k % elems != 0 || k % 32 != 0) return 1;
  if (rows == 0 || n == 0) return 0;
  const int64_t m_pad = (rows + 15) / 16 * 16, pairs = k / 2, chunks = k / 32, row_bytes = k / elems * bytes;
  const int64_t runs = (chunks + AMX_K_CHUNKS - 1) / AMX_K_CHUNKS, run = (chunks + runs - 1) / runs;
  int64_t block_rows = AMX_B_BYTES / (k * 2) / 32 * 32;
  if (block_rows < 32) block_rows = 32;
  if (block_rows > m_pad) block_rows = (m_pad + 31) / 32 * 32;
  const int64_t panels = (n + AMX_PANEL - 1) / AMX_PANEL;
  if (num_threads < 1 || panels < 4) num_threads = 1;
  /* per thread: the blocked panel, then the parked C tiles of a block of rows */
  const int64_t panel_elems = AMX_PANEL * k, acc_floats = runs > 1 ? block_rows * AMX_PANEL : 0;
  const size_t acc_at = (sizeof(uint16_t) * (size_t)panel_elems + 63) / 64 * 64;
  const size_t per_thread = acc_at + (sizeof(float) * (size_t)acc_floats + 63) / 64 * 64;
  uint32_t *xt = aligned_alloc(64, sizeof(uint32_t) * (size_t)(pairs * m_pad));
  char *work = aligned_alloc(64, per_thread * (size_t)num_threads);
  if (!xt || !work) {
    free(xt), free(work);
    return 2;
  }
  tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
#pragma omp parallel num_threads(num_threads)
  {
    char *mine = thread_share(work, per_thread);
    uint16_t *panel = (uint16_t *)mine;
    float *acc = (float *)(mine + acc_at);
    float c[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int64_t mb = 0; mb < m_pad / 16; mb++) amx_b_block(x, x_stride, rows, mb, pairs, xt);
    _tile_loadconfig(&cfg);
    for (int64_t mb0 = 0; mb0 < m_pad; mb0 += block_rows) {
      const int64_t mb1 = mb0 + block_rows < m_pad ? mb0 + block_rows : m_pad;
#pragma omp for schedule(guided)
      for (int64_t p = 0; p < panels; p++) {
        const int64_t j0 = p * AMX_PANEL, cols = n - j0 < AMX_PANEL ? n - j0 : AMX_PANEL;
        for (int64_t r = 0; r < AMX_PANEL; r++) {
          uint16_t *dst = panel + (r / 16) * chunks * 512 + (r % 16) * 32;
          /* the bytes 4 KB on, as the GEMVs ask (spread over the panel's rows: the whole next panel asked for at
           * once made the LM head at 8-16 rows 6-10% slower) */
          prefetch_ahead(weight + (j0 + r) * row_bytes, row_bytes);
          if (r < cols) deq(weight + (j0 + r) * row_bytes, NULL, dst, 512, 0, k / elems);
          else for (int64_t ch = 0; ch < chunks; ch++) memset(dst + ch * 512, 0, 64);
        }
        for (int64_t ch0 = 0; ch0 < chunks; ch0 += run) {
          const int64_t ch1 = ch0 + run < chunks ? ch0 + run : chunks;
          const int first = ch0 == 0, last = ch1 == chunks;
          for (int64_t m0 = mb0; m0 < mb1; m0 += 32) {
            const int two = m0 + 16 < mb1; /* a second block of 16 rows of x */
            const uint32_t *b0 = xt + (m0 / 16) * pairs * 16, *b1 = b0 + pairs * 16;
            float *parked = acc + (m0 - mb0) * AMX_PANEL; /* four tiles: (lo, hi) x (rows m0, m0 + 16) */
            if (first) {
              _tile_zero(0);
              _tile_zero(1);
              _tile_zero(2);
              _tile_zero(3);
            } else {
              _tile_loadd(0, parked, 64);
              _tile_loadd(1, parked + 256, 64);
              _tile_loadd(2, parked + 512, 64);
              _tile_loadd(3, parked + 768, 64);
            }
            for (int64_t ch = ch0; ch < ch1; ch++) {
              _tile_loadd(4, panel + ch * 512, 64);
              _tile_loadd(5, panel + (chunks + ch) * 512, 64);
              _tile_loadd(6, b0 + ch * 256, 64);
              _tile_dpbf16ps(0, 4, 6);
              _tile_dpbf16ps(2, 5, 6);
              if (two) {
                _tile_loadd(7, b1 + ch * 256, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
              }
            }
            if (!last) {
              _tile_stored(0, parked, 64);
              _tile_stored(1, parked + 256, 64);
              _tile_stored(2, parked + 512, 64);
              _tile_stored(3, parked + 768, 64);
              continue;
            }
            _tile_stored(0, c[0], 64);
            _tile_stored(2, c[2], 64);
            const int64_t r0 = rows - m0 < 16 ? rows - m0 : 16;
            if (r0 > 0) store_tiles(c[0], c[2], r0, cols, y, y_stride, (int)y_bf16, m0, j0);
            if (two) {
              _tile_stored(1, c[1], 64);
              _tile_stored(3, c[3], 64);
              const int64_t r1 = rows - m0 - 16 < 16 ? rows - m0 - 16 : 16;
              if (r1 > 0) store_tiles(c[1], c[3], r1, cols, y, y_stride, (int)y_bf16, m0 + 16, j0);
            }
          }
        }
      }
    }
    _tile_release();
  }
  free(work);
  free(xt);
  return 0;
}
#endif
