/* top_k / top_p rows of the fused LM head (cpu_fused_head.c): per-chunk candidates, then the exact kept set.
 *
 * The specification is sampling/torch_sampling.py (min_p 0): x = logit * (1 / T), m = max x; top_k keeps x >= the
 * k-th largest x; top_p keeps the groups of equal x (most likely first) whose strictly-more-likely kept mass is
 * below top_p * W, masses being trunc(exp32(x - m) * 2^32) and W their sum over the kept set; then the Gumbel-max
 * race over the kept set.
 *
 * Each thread keeps, per row, the largest x it has seen (a buffer of 2C, cut back to its C largest when full:
 * every element above the cut's value `thr` stays), a running max, and, for top_p, the float64 sum s of exp(x - m)
 * over the elements it dropped or never kept, counted only within MASS_SPAN of the running max (below that an
 * element's mass is exactly 0 whatever the final max). At the end the threads' buffers are merged and cut to C:
 * every element above `low` (the highest cut) is then in the list, with its exact mass. The kept set is decided
 * from the list when it provably can be:
 *   - top_k: the k-th largest must lie above `low` (C > k, so only ties spanning the cut fail);
 *   - top_p: W is the list's exact mass plus the dropped mass, bounded by s * 2^32 * (1 -+ MASS_REL) (see
 *     MASS_REL; truncation loses < 1 per element); each group is kept when its mass above is below
 *     top_p * W_lo, dropped (with every later one) when at least top_p * W_hi, and must lie above `low` when kept.
 * Otherwise the row's status is HEAD_FALLBACK and the caller samples its logits unfused: same tokens either way.
 * A flat row is given up early (HEAD_GIVE_UP): its candidates churn at every chunk and prove nothing in the end.
 */
#ifndef PAGODA_CPU_HEAD_NUCLEUS_H
#define PAGODA_CPU_HEAD_NUCLEUS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define HEAD_MAX_TOP_K 4096 /* larger top_k: not fused (the caller's eligibility) */
#define HEAD_NUCLEUS 1024   /* candidates of a top_p row without top_k */
#define MASS_SPAN 23.0f     /* exp(-23) * 2^32 < 0.5: an element this far below the max has mass 0 */
/* s against the list's masses: each term is exp32 (within a few ulp of exp) of an x - m rounded in float32
 * (|x - m| < 32: <= 2^-20 absolute, so ~1e-6 relative), taken against the max of its time and scaled to the final
 * one in float64 (another such rounding); with room */
#define MASS_REL 1e-5
#define HEAD_FALLBACK 3     /* status: the candidates cannot prove the kept set; sample this row unfused */
/* A top_p row is decided only if its list (C masses of at most 1 each, in units of the max) holds top_p of W, so
 * only if the dropped mass is below C (1 - top_p) / top_p; once a thread's dropped mass s (in units of its max so
 * far) is this many times that, the row is given up: only a far larger max later could still decide it, and then
 * the unfused draw gives the same token anyway. */
#define HEAD_GIVE_UP 2.0

typedef struct {
  float x;
  int32_t i;
} cand_t;

/* One thread's state of one top_k / top_p row. */
typedef struct {
  cand_t *c;      /* [2 * cap] */
  int64_t n, cap; /* entries held; C */
  float thr;      /* every element above thr is held (-inf: none dropped yet) */
  int pruned;     /* some element was dropped */
  float m;        /* running max */
  double s;       /* sum of exp(x - m) of the dropped elements within MASS_SPAN of m when dropped */
  int64_t ns;     /* how many terms s has */
  int mass;       /* top_p: track s */
  double hopeless; /* top_p without top_k: s beyond this gives the row up (see nucleus_chunk); else +inf */
  int gave_up;
} nucleus_t;

PAGODA_DEFINE_EXP32(hv_exp32, hvf, hvi) /* cpu_gumbel.h */

/* One exp32: the vector's operations on a broadcast (the same bits as cpu_sampling.c's exp32). */
static inline float exp32_scalar(float x) { return hv_exp32((hvf){0} + x)[0]; }

/* Descending x, then ascending index. */
static int cand_order(const void *a, const void *b) {
  const cand_t *p = a, *q = b;
  if (p->x != q->x) return p->x > q->x ? -1 : 1;
  return (p->i > q->i) - (p->i < q->i);
}

static inline void nucleus_rest(nucleus_t *t, float x, float m) {
  if (t->mass && x >= m - MASS_SPAN) t->s += exp((double)x - (double)m), t->ns++;
}

/* Whether a comes before b in cand_order. */
static inline int cand_before(cand_t a, cand_t b) { return a.x > b.x || (a.x == b.x && a.i < b.i); }

/* Reorder c[0..n) so that c[p] is the entry at position p of cand_order, those before it in any order ahead of it
 * and the rest after (Wirth's selection; indices are distinct, so the order is strict). Why not qsort: a full
 * list is cut every C new candidates, and sorting it was a twelfth of a 4-row top_p step on Gemma 3's head. */
static void cand_select(cand_t *c, int64_t n, int64_t p) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const cand_t pivot = c[p];
    int64_t i = lo, j = hi;
    do {
      while (cand_before(c[i], pivot)) i++;
      while (cand_before(pivot, c[j])) j--;
      if (i <= j) {
        const cand_t swap = c[i];
        c[i++] = c[j];
        c[j--] = swap;
      }
    } while (i <= j);
    if (j < p) lo = i;
    if (p < i) hi = j;
  }
}

/* Cut the buffer back to its `keep` largest (the rest go to s); thr becomes the last one kept. `sorted`: the kept
 * ones end in cand_order (the final merge reads them so), else in any order. */
static void nucleus_cut(nucleus_t *t, int64_t keep, int sorted) {
  if (sorted)
    qsort(t->c, (size_t)t->n, sizeof(cand_t), cand_order);
  else if (t->n > keep)
    cand_select(t->c, t->n, keep - 1);
  if (t->n <= keep) return;
  for (int64_t e = keep; e < t->n; e++) nucleus_rest(t, t->c[e].x, t->m);
  t->n = keep;
  if (!t->pruned || t->c[keep - 1].x > t->thr) t->thr = t->c[keep - 1].x;
  t->pruned = 1;
}

/* One finite x at vocabulary index j. */
static inline void nucleus_feed(nucleus_t *t, float x, int64_t j) {
  if (x > t->m) {
    if (t->mass && t->m > -INFINITY) t->s *= exp((double)t->m - (double)x);
    t->m = x;
  }
  if (t->pruned && !(x > t->thr)) {
    nucleus_rest(t, x, t->m);
    return;
  }
  if (t->n == 2 * t->cap) {
    nucleus_cut(t, t->cap, 0);
    if (!(x > t->thr)) {
      nucleus_rest(t, x, t->m);
      return;
    }
  }
  t->c[t->n++] = (cand_t){x, (int32_t)j};
}

typedef float hvfh __attribute__((vector_size(2 * HEAD_LANES)));  /* half an hvf */
typedef double hvd __attribute__((vector_size(4 * HEAD_LANES))); /* an hvfh as doubles: one register */

/* Feed a chunk's x = y * factor (HEAD_CHUNK values; lanes past the end are -inf). The chunk's max is taken first,
 * so every lane's mass is against a max at least its own x. Then HEAD_LANES lanes at a time: those above thr go to
 * the list (nucleus_feed); for top_p, once the list has been cut, the others within MASS_SPAN of the max add their
 * exp(x - m) to s in vectors (exp32 of x - m in float32, summed in float64; why not a scalar exp each: on a flat
 * row of Gemma 3's 262k logits that was most lanes, and cost a 4-row step more than the whole draw saved). */
static void nucleus_chunk(nucleus_t *t, const float *y, int64_t j0, float factor, int *bad, int *any) {
  enum { V = HEAD_CHUNK / HEAD_LANES };
  hvf xs[V];
  hvi vbad = (hvi){0}, vany = (hvi){0};
  hvf top = (hvf){0} - INFINITY;
  for (int v = 0; v < V; v++) {
    hvf x;
    memcpy(&x, y + v * HEAD_LANES, sizeof x);
    x = x * factor;
    vbad |= (x != x) | (x == INFINITY);
    const hvi finite = (x > -INFINITY) & (x < INFINITY);
    vany |= finite;
    const hvi higher = finite & (x > top);
    top = (hvf)(((hvi)x & higher) | ((hvi)top & ~higher));
    xs[v] = x;
  }
  *bad |= hv_any(vbad);
  *any |= hv_any(vany);
  if (t->gave_up) return;
  float cm = -INFINITY;
  for (int l = 0; l < HEAD_LANES; l++) cm = top[l] > cm ? top[l] : cm;
  if (cm > t->m) {
    if (t->mass && t->m > -INFINITY) t->s *= exp((double)t->m - (double)cm);
    t->m = cm;
  }
  hvd acc = (hvd){0};
  hvi count = (hvi){0};
  for (int v = 0; v < V; v++) {
    const hvf x = xs[v];
    const hvi finite = (x > -INFINITY) & (x < INFINITY);
    const hvi keep = (x > (t->pruned ? t->thr : -INFINITY)) & finite;
    if (t->mass && t->pruned) {
      const hvi rest = ~keep & finite & (x >= t->m - MASS_SPAN);
      if (hv_any(rest)) {
        const hvf e = (hvf)((hvi)hv_exp32(x - t->m) & rest);
        hvfh half[2];
        memcpy(half, &e, sizeof half);
        acc += __builtin_convertvector(half[0], hvd) + __builtin_convertvector(half[1], hvd);
        count -= rest; /* true is -1 */
      }
    }
    if (!hv_any(keep)) continue;
    for (int l = 0; l < HEAD_LANES; l++)
      if (keep[l]) nucleus_feed(t, x[l], j0 + v * HEAD_LANES + l);
  }
  for (int l = 0; l < HEAD_LANES / 2; l++) t->s += acc[l];
  for (int l = 0; l < HEAD_LANES; l++) t->ns += count[l];
  t->gave_up = t->s > t->hopeless;
}

/* The row's token from the threads' states (each of cap C): its index, or -1 for HEAD_FALLBACK. `top_k` 0 when
 * disabled, `top_p` 1 when disabled. `all` has room for every thread's 2C entries. */
static int64_t nucleus_draw(nucleus_t *ts, int64_t threads, int64_t top_k, float top_p, uint64_t key,
                            cand_t *all) {
  nucleus_t u = {all, 0, ts[0].cap, -INFINITY, 0, -INFINITY, 0.0, 0, ts[0].mass, INFINITY, 0};
  for (int64_t t = 0; t < threads; t++) {
    if (ts[t].gave_up) return -1;
    u.m = ts[t].m > u.m ? ts[t].m : u.m;
  }
  for (int64_t t = 0; t < threads; t++) {
    const nucleus_t *p = &ts[t];
    for (int64_t e = 0; e < p->n; e++) all[u.n++] = p->c[e];
    if (p->pruned) u.thr = u.pruned && u.thr > p->thr ? u.thr : p->thr, u.pruned = 1;
    if (p->ns) u.s += p->s * exp((double)p->m - (double)u.m), u.ns += p->ns;
  }
  nucleus_cut(&u, u.cap, 1); /* sorts, and drops what is past C */
  const float low = u.pruned ? u.thr : -INFINITY;
  const float m = u.c[0].x;
  int64_t n1 = u.n; /* the kept set after top_k: the first n1 */
  if (top_k > 0) {
    if (u.n >= top_k) {
      const float kth = u.c[top_k - 1].x;
      if (u.pruned && !(kth > low)) return -1;
      while (n1 > top_k && !(u.c[n1 - 1].x >= kth)) n1--;
    } else if (u.pruned) {
      return -1; /* cannot happen: C > top_k */
    }
  }
  int64_t kept = n1;
  if (top_p < 1.0f) {
    int64_t w_list = 0;
    for (int64_t e = 0; e < n1; e++) w_list += (int64_t)(exp32_scalar(u.c[e].x - m) * 0x1p32f);
    double w_lo = (double)w_list, w_hi = (double)w_list;
    const int open = top_k == 0 && u.pruned; /* W has mass outside the list */
    if (open) {
      const double rest = u.s * 0x1p32;
      const double lo = rest * (1.0 - MASS_REL) - (double)u.ns - 1.0;
      w_lo += lo > 0.0 ? floor(lo) : 0.0;
      w_hi += ceil(rest * (1.0 + MASS_REL) + 1.0);
    }
    const double t_lo = (double)top_p * w_lo, t_hi = (double)top_p * w_hi;
    int64_t above = 0, g = 0;
    kept = -1;
    while (g < n1) {
      int64_t end = g, mass = 0;
      while (end < n1 && u.c[end].x == u.c[g].x) mass += (int64_t)(exp32_scalar(u.c[end].x - m) * 0x1p32f), end++;
      if ((double)above >= t_hi) {
        kept = g;
        break;
      }
      if (!((double)above < t_lo)) return -1; /* between the bounds: undecided */
      if (u.pruned && !(u.c[g].x > low)) return -1; /* kept, but some of its ties may be missing */
      above += mass;
      g = end;
    }
    if (kept < 0) {
      if (open) return -1; /* the nucleus may reach below the list */
      kept = n1;
    }
  } else if (top_k == 0 && u.pruned) {
    return -1; /* not a truncated row: the caller does not send these */
  }
  float best = -INFINITY;
  int64_t best_i = -1;
  for (int64_t e = 0; e < kept; e++) {
    const float s = gumbel_score(u.c[e].x, word_at(key, u.c[e].i));
    if (best_i < 0 || s > best || (s == best && u.c[e].i < best_i)) best = s, best_i = u.c[e].i;
  }
  return best_i;
}

#endif
