# The kernels are Triton IR, not typed Python: their arguments are pointers, scalars and constexprs.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
"""@triton.jit kernel behind `triton_sampling`: the fused sampling op, one program per row.

The program walks its row in blocks: the max and lowest argmax (and NaN / +inf) first; for a sampled row then
top_k's and top_p's thresholds, each by a 32-step bisection over the order-preserving integer keys of x (a GPU
reads a row from L2 32 times faster than it sorts it); last the Gumbel-max race over the kept tokens. The float
math is fmath's operation sequence and the RNG rng's, so with fused multiply-adds disabled at launch
(enable_fp_fusion=False) the tokens are bitwise those of the torch specification.
"""

from __future__ import annotations

import triton
import triton.language as tl

# fmath's constants (float32 values): globals read inside kernels must be tl.constexpr instances.
LOG2E = tl.constexpr(float.fromhex("0x1.715476p+0"))
LN2_HI = tl.constexpr(float.fromhex("0x1.63p-1"))
LN2_LO = tl.constexpr(float.fromhex("-0x1.bd0106p-13"))
EXP_LO = tl.constexpr(-86.0)
E0 = tl.constexpr(float.fromhex("0x1.a0d2cep-13"))
E1 = tl.constexpr(float.fromhex("0x1.6e879cp-10"))
E2 = tl.constexpr(float.fromhex("0x1.11121p-7"))
E3 = tl.constexpr(float.fromhex("0x1.555382p-5"))
E4 = tl.constexpr(float.fromhex("0x1.555554p-3"))
E5 = tl.constexpr(0.5)
SQRT_HALF = tl.constexpr(float.fromhex("0x1.6a09e6p-1"))
L0 = tl.constexpr(float.fromhex("0x1.204376p-4"))
L1 = tl.constexpr(float.fromhex("-0x1.d7a37p-4"))
L2 = tl.constexpr(float.fromhex("0x1.de4a34p-4"))
L3 = tl.constexpr(float.fromhex("-0x1.fcba9ep-4"))
L4 = tl.constexpr(float.fromhex("0x1.23d37ep-3"))
L5 = tl.constexpr(float.fromhex("-0x1.555cap-3"))
L6 = tl.constexpr(float.fromhex("0x1.999d58p-3"))
L7 = tl.constexpr(float.fromhex("-0x1.fffff8p-3"))
L8 = tl.constexpr(float.fromhex("0x1.555554p-2"))
# rng's constants
GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
MIX_1 = tl.constexpr(0xBF58476D1CE4E5B9)
MIX_2 = tl.constexpr(0x94D049BB133111EB)
MASS_SCALE = tl.constexpr(4294967296.0)  # 2^32


@triton.jit
def _exp32(x):
    """fmath.exp32 (lanes below EXP_LO are computed on 0 and then zeroed, so no int conversion sees -inf)."""
    under = x < EXP_LO
    xs = tl.where(under, 0.0, x)
    n = tl.floor(xs * LOG2E + 0.5)
    r = xs - n * LN2_HI
    r = r - n * LN2_LO
    z = r * r
    p = E0 * r + E1
    p = p * r + E2
    p = p * r + E3
    p = p * r + E4
    p = p * r + E5
    y = p * z + r + 1.0
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(under, 0.0, y * scale)


@triton.jit
def _log32(y):
    """fmath.log32 for positive normal y."""
    bits = y.to(tl.int32, bitcast=True)
    mantissa = ((bits & 0x007FFFFF) | 0x3F000000).to(tl.float32, bitcast=True)
    small = mantissa < SQRT_HALF
    e = ((bits >> 23) - 126 - small.to(tl.int32)).to(tl.float32)
    x = tl.where(small, mantissa + mantissa - 1.0, mantissa - 1.0)
    z = x * x
    p = L0 * x + L1
    p = p * x + L2
    p = p * x + L3
    p = p * x + L4
    p = p * x + L5
    p = p * x + L6
    p = p * x + L7
    p = p * x + L8
    r = p * x * z
    r = r + e * LN2_LO
    r = r - 0.5 * z
    return x + r + e * LN2_HI


@triton.jit
def _gumbel(x, key, offs):
    """x - log(-log u) with u from rng.uniforms at vocabulary indices `offs` (int64) of the row keyed `key`."""
    z = key + ((offs >> 1).to(tl.uint64) + 1) * GOLDEN
    z = (z ^ (z >> 30)) * MIX_1
    z = (z ^ (z >> 27)) * MIX_2
    h = z ^ (z >> 31)
    word = tl.where((offs & 1) == 1, h >> 32, h & 0xFFFFFFFF)
    u = ((word >> 9) * 2 + 1).to(tl.int32).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
    return x - _log32(-_log32(u))


@triton.jit
def _block(row, offs, vocab, scale, m, min_p):
    """x = logits * (1/T) of one block, its exp32(x - m), its min_p mask and its order-preserving keys."""
    x = tl.load(row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * scale
    e = _exp32(x - m)
    keep = (x > float("-inf")) & (e >= min_p)
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    key = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)
    return x, e, keep, key


@triton.jit
def _bisect(row, lanes, vocab, scale, m, min_p, cut, limit, UNIT: tl.constexpr, BLOCK: tl.constexpr):
    """The smallest key whose weight above, over the kept keys >= cut, is below limit: 32 halvings of [0, 2^32).
    Weights are 1 (UNIT, top_k) or the masses trunc(e * 2^32) (top_p)."""
    lo = tl.full([], 0, tl.int64)
    hi = tl.full([], 0xFFFFFFFF, tl.int64)
    for _ in range(32):
        mid = (lo + hi) // 2
        above = tl.full([], 0, tl.int64)
        for start in range(0, vocab, BLOCK):
            _x, e, keep, k = _block(row, start + lanes, vocab, scale, m, min_p)
            weight = 1 if UNIT else (e * MASS_SCALE).to(tl.int64)
            above += tl.sum(tl.where(keep & (k >= cut) & (k > mid), weight, 0), axis=0)
        ok = above.to(tl.float64) < limit
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid + 1)
    return lo


@triton.jit
def sample_kernel(
    logits_ptr,  # [rows, vocab], rows `stride` elements apart
    stride,
    vocab,
    inv_t_ptr,  # float32 [rows]; 0: greedy
    top_k_ptr,  # int64 [rows]; 0: disabled
    top_p_ptr,  # float32 [rows]; 1: disabled
    min_p_ptr,  # float32 [rows]
    keys_ptr,  # int64 [rows]
    tokens_ptr,  # int64 [rows] out
    status_ptr,  # int32 [rows] out
    mask_ptr,  # uint8 [rows, vocab] out, written when WRITE_MASK
    WRITE_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One token and status per row, and the kept mask when WRITE_MASK (torch_sampling.run specifies them)."""
    r = tl.program_id(0).to(tl.int64)
    row = logits_ptr + r * stride
    inv_t = tl.load(inv_t_ptr + r)
    scale = tl.where(inv_t == 0.0, 1.0, inv_t)  # greedy rows see the logits themselves
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    # Max and lowest argmax of the logits, per lane then across lanes; NaN / +inf anywhere.
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_arg = tl.full([BLOCK], 0, tl.int64)
    lane_bad = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        v = tl.load(row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        lane_bad = lane_bad | ((v != v) | (v == float("inf"))).to(tl.int32)
        gt = v > lane_max
        lane_max = tl.where(gt, v, lane_max)
        lane_arg = tl.where(gt, offs, lane_arg)
    lmax = tl.max(lane_max, axis=0)
    arg = tl.min(tl.where(lane_max == lmax, lane_arg, vocab), axis=0)
    m = lmax * scale
    # 1: NaN or +inf (also after 1/T); 2: every logit -inf
    bad = (tl.max(lane_bad, axis=0) != 0) | (m == float("inf"))
    status = tl.where(bad, 1, tl.where(lmax == float("-inf"), 2, 0))
    token = tl.where(status == 0, arg, 0)
    sampled = (status == 0) & (inv_t != 0.0)
    cut = tl.full([], 0, tl.int64)  # kept tokens have key >= cut
    min_p = tl.load(min_p_ptr + r)
    key = tl.load(keys_ptr + r).to(tl.uint64, bitcast=True)
    if sampled:
        top_k = tl.load(top_k_ptr + r)
        top_p = tl.load(top_p_ptr + r)
        if (top_k > 0) & (top_k < vocab):
            # The smallest key with fewer than k min_p-kept keys above it.
            cut = _bisect(row, lanes, vocab, scale, m, min_p, cut, top_k.to(tl.float64), True, BLOCK)
        if top_p < 1.0:
            total = tl.full([], 0, tl.int64)
            for start in range(0, vocab, BLOCK):
                _x, e, keep, k = _block(row, start + lanes, vocab, scale, m, min_p)
                total += tl.sum(tl.where(keep & (k >= cut), (e * MASS_SCALE).to(tl.int64), 0), axis=0)
            # The smallest key whose kept mass above is below top_p of the kept mass.
            limit = top_p.to(tl.float64) * total.to(tl.float64)
            cut = tl.maximum(cut, _bisect(row, lanes, vocab, scale, m, min_p, cut, limit, False, BLOCK))
        # The Gumbel-max race over the kept tokens; the lowest index wins a tie.
        best = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], 0, tl.int64)
        for start in range(0, vocab, BLOCK):
            offs = start + lanes
            x, e, keep, k = _block(row, offs, vocab, scale, m, min_p)
            s = tl.where(keep & (k >= cut), _gumbel(x, key, offs), float("-inf"))
            block_best = tl.max(s, axis=0)
            block_i = tl.min(tl.where(s == block_best, offs, vocab), axis=0)
            better = block_best > best
            best_i = tl.where(better, block_i, best_i)
            best = tl.where(better, block_best, best)
        token = best_i
    tl.store(tokens_ptr + r, token)
    tl.store(status_ptr + r, status)
    if WRITE_MASK:
        for start in range(0, vocab, BLOCK):
            offs = start + lanes
            kept = offs < 0  # all False
            if status == 0:
                _x, _e, keep, k = _block(row, offs, vocab, scale, m, min_p)
                kept = tl.where(inv_t != 0.0, keep & (k >= cut), offs == arg)
            tl.store(mask_ptr + r * vocab + offs, kept.to(tl.uint8), mask=offs < vocab)
