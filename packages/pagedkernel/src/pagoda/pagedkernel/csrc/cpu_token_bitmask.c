/* Grammar token bitmask on the CPU: logits[row, t] = -inf wherever bit t % 32 of word t / 32 of the row's packed
 * bitmask is 0, and past the grammar's vocabulary, for the listed rows only.
 *
 * The specification is pagoda/pagedkernel/sampling/token_bitmask.py's torch path. The work is a masked store,
 * so it goes a 32-token word at a time: a word of ones (inside a JSON string most of the vocabulary is allowed)
 * is skipped, a word of zeros (between JSON tokens almost nothing is) is one run of -inf stores the compiler
 * vectorises, and only mixed words test bits. Storing -inf's bit pattern makes one library serve every dtype:
 * the caller passes the element size and the pattern. One thread: the stores are bound by memory bandwidth, and
 * the step's other threads (the grammar fill, the next forward) want the cores more than a second thread here.
 */
#include <stdint.h>

/* One row: skip all-allowed words, store runs of -inf for all-masked ones, test bits in the rest; then the
 * columns past the vocabulary. Defined once per element width (T: the element's bits as an unsigned integer). */
#define DEFINE_MASK_ROW(name, T)                                                                   \
  static void name(T *x, const int32_t *mask, int64_t vocab, int64_t width, T neg) {               \
    for (int64_t base = 0; base < vocab; base += 32) {                                             \
      const uint32_t word = (uint32_t)mask[base / 32];                                             \
      const int64_t n = vocab - base < 32 ? vocab - base : 32;                                     \
      if (word == 0xFFFFFFFFu) continue;                                                           \
      if (word == 0) {                                                                             \
        for (int64_t b = 0; b < n; ++b) x[base + b] = neg;                                         \
        continue;                                                                                  \
      }                                                                                            \
      for (int64_t b = 0; b < n; ++b)                                                              \
        if (!((word >> b) & 1u)) x[base + b] = neg;                                                \
    }                                                                                              \
    for (int64_t t = vocab; t < width; ++t) x[t] = neg;                                            \
  }

DEFINE_MASK_ROW(mask_row16, uint16_t)
DEFINE_MASK_ROW(mask_row32, uint32_t)

/* logits: rows of `width` elements of `elem_size` bytes (2 or 4), `logits_stride` elements apart; bitmask: int32
 * rows `bitmask_stride` words apart covering `vocab` (<= width) tokens; rows: the `num_rows` row indices to mask.
 * Returns 0, or 1 for an element size other than 2 or 4. */
int pagoda_apply_token_bitmask(void *logits, int64_t elem_size, int64_t logits_stride, int64_t width,
                               const int32_t *bitmask, int64_t bitmask_stride, const int64_t *rows,
                               int64_t num_rows, int64_t vocab, uint32_t neg) {
  if (elem_size != 2 && elem_size != 4) return 1;
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t r = rows[i];
    if (elem_size == 2)
      mask_row16((uint16_t *)logits + r * logits_stride, bitmask + r * bitmask_stride, vocab, width,
                 (uint16_t)neg);
    else
      mask_row32((uint32_t *)logits + r * logits_stride, bitmask + r * bitmask_stride, vocab, width, neg);
  }
  return 0;
}
