# The kernels are Triton IR, not typed Python: their arguments are pointers, scalars and constexprs.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
"""@triton.jit kernels behind `triton_backend`: cache writes, block copies, split-K decode and varlen prefill.

K/V are read through the block table one token row at a time (row = one token's head_dim values for one KV
head), so any cache block size works and tiles need not align with blocks. Each attention program serves one KV
head and all the query heads of its GQA group, so K/V are loaded once per group. Softmax runs online in float32
with the running max started at a finite -1e30 instead of -inf: a tile where a row sees no key then gives
exp(-inf - (-1e30)) = 0 instead of NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Globals read inside kernels must be tl.constexpr instances.
NEG_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _softcap(s, softcap):
    """softcap * tanh(s / softcap), with tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at both ends."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """a @ b with float32 accumulation; with F32 in full float32 precision (no TF32), operands upcast first."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _round_fp8(x, FP8_MAX: tl.constexpr, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr):
    """x (float32) saturated to +-FP8_MAX and rounded to nearest even on an fp8 format's grid (MANT mantissa
    bits, smallest normal MIN_NORMAL), so that the cast after it is exact: Triton 3.9's interpreter rounds fp8
    casts wrongly (values just below a power of two lose their carry), and this is the same on every target.
    Normals round by integer arithmetic on the bits (the carry runs into the exponent); subnormals by adding and
    subtracting MAGIC, a float32 whose unit in the last place is the format's subnormal step."""
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    DROP: tl.constexpr = 23 - MANT
    u = x.to(tl.uint32, bitcast=True)
    lsb = (u >> DROP) & 1
    u = ((u + ((1 << (DROP - 1)) - 1) + lsb) >> DROP) << DROP
    normal = u.to(tl.float32, bitcast=True)
    a = tl.abs(x)
    sub = (a + MAGIC) - MAGIC
    sub = tl.where(x < 0, -sub, sub)
    return tl.where(a < MIN_NORMAL, sub, normal)


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], heads and dims contiguous
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], heads and dims contiguous
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping_ptr,  # int64 [num_tokens]
    stride_key_t,
    stride_value_t,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_MAX: tl.constexpr = 0.0,  # an fp8 cache's largest finite value (saturate to it); 0: not fp8
    FP8_MANT: tl.constexpr = 3,  # its mantissa bits
    FP8_MIN_NORMAL: tl.constexpr = 0.0,  # its smallest normal value
    FP8_MAGIC: tl.constexpr = 0.0,  # MIN_NORMAL * 2**(23 - MANT): see _round_fp8
):
    """One program per token: copy its K and V row into slot slot_mapping[t], nothing when negative."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t)
    offs = tl.arange(0, ROW_PAD)
    # A negative slot shrinks the row to nothing (a vector compare keeps the mask a plain boolean vector).
    ok = offs < tl.where(slot >= 0, ROW, 0)
    # Cache rows are contiguous, so slot * ROW addresses (block, offset) directly.
    dst = slot * ROW + offs
    k = tl.load(key_ptr + t * stride_key_t + offs, mask=ok)
    v = tl.load(value_ptr + t * stride_value_t + offs, mask=ok)
    if FP8_MAX > 0.0:
        # e4m3fn has no infinity: an out-of-range value would round to NaN, so saturate first (as torch's to_fp8).
        k = _round_fp8(k.to(tl.float32), FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_MAGIC)
        v = _round_fp8(v.to(tl.float32), FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_MAGIC)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def copy_blocks_kernel(
    src_ptrs,  # int64 [num_caches], base address of each source cache
    dst_ptrs,  # int64 [num_caches], base address of each destination cache
    ref_ptr,  # any cache of the element type, only its pointer type is used
    block_pairs_ptr,  # int64 [num_pairs, 2]
    block_numel,
    CHUNK: tl.constexpr,
):
    """Grid (pair, cache, chunk): copy CHUNK elements of block src to block dst, for every cache in one launch."""
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    chunk = tl.program_id(2)
    src_block = tl.load(block_pairs_ptr + 2 * pair)
    dst_block = tl.load(block_pairs_ptr + 2 * pair + 1)
    # Caches of different layers are separate allocations: their addresses travel as integers.
    src = tl.load(src_ptrs + cache).to(ref_ptr.dtype)
    dst = tl.load(dst_ptrs + cache).to(ref_ptr.dtype)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < block_numel
    x = tl.load(src + src_block * block_numel + offs, mask=ok)
    tl.store(dst + dst_block * block_numel + offs, x, mask=ok)


@triton.jit
def _load_keys(
    k_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    row,  # int64 [TOKENS], each key's first element in the cache
    block,  # [TOKENS], each key's cache block
    pos,  # [TOKENS], each key's position
    kv_head,
    dims,  # [HEAD_DIM_PAD]
    kv_mask,  # [TOKENS, HEAD_DIM_PAD]
    tok_ok,  # [TOKENS]
    dtype: tl.constexpr,
    stride_k_s,  # elements from one cache slot to the next: num_kv_heads * head_dim
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INT8: tl.constexpr,
    F32: tl.constexpr,
):
    """Key rows in `dtype` (int8: dequantized by their block's channel scales), and the value rows' scales (1.0
    unless INT8). An fp8 cache's rows are widened to `dtype` (a no-op for a cache of `dtype`)."""
    k = tl.load(k_cache_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if INT8:
        # k_scale [blocks, kvh, d]: one channel row per block and head; v_scale [blocks, bs, kvh]: one per slot.
        b = block.to(tl.int64)
        num_kv_heads = stride_k_s // HEAD_DIM
        k_scale = tl.load(
            k_scale_ptr + (b * num_kv_heads + kv_head)[:, None] * HEAD_DIM + dims[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)  # bfloat16 scales
        v_scale = tl.load(
            v_scale_ptr + (b * BLOCK_SIZE + pos % BLOCK_SIZE) * num_kv_heads + kv_head, mask=tok_ok, other=0.0
        )
        if (
            F32
        ):  # kept in float32: _dot upcasts anyway (and the interpreter's float32 -> bfloat16 cast is wrong)
            return k.to(tl.float32) * k_scale, v_scale
        return (k.to(tl.float32) * k_scale).to(dtype), v_scale
    return k.to(dtype), tl.full(pos.shape, 1.0, tl.float32)


@triton.jit
def paged_decode_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim], written when ONE_PARTITION
    part_acc_ptr,  # float32 [num_seqs, num_heads, num_partitions, HEAD_DIM_PAD], unnormalised
    part_max_ptr,  # float32 [num_seqs, num_heads, num_partitions]
    part_sum_ptr,  # float32 [num_seqs, num_heads, num_partitions]
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # same strides as k_cache
    k_scale_ptr,  # INT8: bfloat16 [num_blocks, num_kv_heads, head_dim] (else any pointer, unread)
    v_scale_ptr,  # INT8: float32 [num_blocks, block_size, num_kv_heads] (else any pointer, unread)
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    context_lens_ptr,  # int32 [num_seqs]
    scale,
    softcap,
    window,
    num_heads,
    num_partitions,
    stride_q_s,
    stride_q_h,
    stride_o_s,
    stride_o_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
    PARTITION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    ONE_PARTITION: tl.constexpr,
    F32: tl.constexpr,
    INT8: tl.constexpr = False,
):
    """Grid (seq, kv_head, partition): online softmax of one query per head of the group over PARTITION keys."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    kv_start = ctx * 0
    if USE_WINDOW:
        kv_start = tl.maximum(ctx - window, 0)
    lo = kv_start + part * PARTITION
    hi = tl.minimum(lo + PARTITION, ctx)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_q_s + heads[:, None] * stride_q_h + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    m = tl.full([GROUP_PAD], NEG_INIT, tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    offs = tl.arange(0, TOKENS)
    for start in range(lo, hi, TOKENS):
        pos = start + offs
        tok_ok = pos < hi
        block = tl.load(
            block_tables_ptr + seq.to(tl.int64) * stride_bt + pos // BLOCK_SIZE, mask=tok_ok, other=0
        )
        row = block.to(tl.int64) * stride_k_b + (pos % BLOCK_SIZE) * stride_k_s + kv_head * stride_k_h
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k, v_scale = _load_keys(
            k_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            row,
            block,
            pos,
            kv_head,
            dims,
            kv_mask,
            tok_ok,
            q.dtype,
            stride_k_s,
            HEAD_DIM,
            BLOCK_SIZE,
            INT8,
            F32,
        )
        s = _dot(q, tl.trans(k), F32) * scale  # [GROUP_PAD, TOKENS]
        if USE_SOFTCAP:
            s = _softcap(s, softcap)
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        if INT8:
            # Each key's value-row scale weights its probability: the int8 row itself is exact in q's dtype.
            v = tl.load(v_cache_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0)
            if F32:
                acc = acc * alpha[:, None] + _dot(p * v_scale[None, :], v.to(tl.float32), F32)
            else:
                acc = acc * alpha[:, None] + _dot((p * v_scale[None, :]).to(q.dtype), v.to(q.dtype), F32)
        else:
            v = tl.load(v_cache_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32)
        m = m_new

    if ONE_PARTITION:
        # Row padding has denom = 0 and is not stored; keep the division finite anyway.
        o = acc / tl.where(row_ok, denom, 1.0)[:, None]
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_o_s + heads[:, None] * stride_o_h + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        # Partitions past the sequence's end have an empty loop: they store denom = 0, which the reduce ignores.
        idx = (seq.to(tl.int64) * num_heads + heads) * num_partitions + part
        tl.store(part_acc_ptr + idx[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_max_ptr + idx, m, mask=row_ok)
        tl.store(part_sum_ptr + idx, denom, mask=row_ok)


@triton.jit
def paged_decode_reduce_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    part_acc_ptr,  # float32 [num_seqs, num_heads, num_partitions, HEAD_DIM_PAD]
    part_max_ptr,  # float32 [num_seqs, num_heads, num_partitions]
    part_sum_ptr,  # float32 [num_seqs, num_heads, num_partitions]
    num_heads,
    num_partitions,
    stride_o_s,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PARTITIONS_PAD: tl.constexpr,
):
    """Grid (seq, head): rescale each partition's partial sums to the global max and normalise once."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.arange(0, PARTITIONS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    part_ok = parts < num_partitions
    base = (seq.to(tl.int64) * num_heads + head) * num_partitions
    mx = tl.load(part_max_ptr + base + parts, mask=part_ok, other=NEG_INIT)
    sm = tl.load(part_sum_ptr + base + parts, mask=part_ok, other=0.0)
    weight = tl.exp(mx - tl.max(mx, 0))  # masked slots: exp(-1e30 - max) = 0
    acc = tl.load(
        part_acc_ptr + (base + parts)[:, None] * HEAD_DIM_PAD + dims[None, :],
        mask=part_ok[:, None],
        other=0.0,
    )
    o = tl.sum(acc * weight[:, None], 0) / tl.sum(weight * sm, 0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_o_s + head * stride_o_h + dims,
        o.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence owning query tile `tile`: sequence s owns tiles from query_start_loc[s] // BLOCK_Q + s on."""
    # Loaded-value arithmetic keeps both bounds runtime scalars: num_seqs == 1 is specialised to a constant,
    # which the loop could not then reassign.
    lo = tl.load(query_start_loc_ptr) * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_prefill_kernel(
    out_ptr,  # [total_query_tokens, num_heads, head_dim]
    q_ptr,  # [total_query_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # same strides as k_cache
    k_scale_ptr,  # INT8: bfloat16 [num_blocks, num_kv_heads, head_dim] (else any pointer, unread)
    v_scale_ptr,  # INT8: float32 [num_blocks, block_size, num_kv_heads] (else any pointer, unread)
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc_ptr,  # int32 [num_seqs + 1]
    context_lens_ptr,  # int32 [num_seqs]
    scale,
    softcap,
    window,
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per tile = BLOCK_Q query tokens x GROUP heads (+ padding)
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    F32: tl.constexpr,
    INT8: tl.constexpr = False,
):
    """Grid (query tile, kv_head): flash attention of BLOCK_Q query tokens x the GROUP heads of one KV head."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    ctx = tl.load(context_lens_ptr + seq)
    first = (
        tile - (q_begin // BLOCK_Q + seq)
    ) * BLOCK_Q  # first query (index within the sequence) of the tile

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    tok = first + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (tok < q_len) & (rows < BLOCK_Q * GROUP)
    q_pos = ctx - q_len + tok
    token = (q_begin + tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_q_t + heads[:, None] * stride_q_h + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # Keys any row of the tile can see: up to its last query, back to the window of its first.
    kv_hi = ctx - q_len + tl.minimum(first + BLOCK_Q, q_len)
    kv_lo = ctx * 0
    if USE_WINDOW:
        kv_lo = tl.maximum(ctx - q_len + first - window + 1, 0)
    kv_hi = tl.where(first < q_len, kv_hi, kv_lo)  # tiles past the sequence's queries do nothing

    m = tl.full([BLOCK_M], NEG_INIT, tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + offs
        tok_ok = pos < kv_hi
        block = tl.load(
            block_tables_ptr + seq.to(tl.int64) * stride_bt + pos // BLOCK_SIZE, mask=tok_ok, other=0
        )
        row = block.to(tl.int64) * stride_k_b + (pos % BLOCK_SIZE) * stride_k_s + kv_head * stride_k_h
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k, v_scale = _load_keys(
            k_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            row,
            block,
            pos,
            kv_head,
            dims,
            kv_mask,
            tok_ok,
            q.dtype,
            stride_k_s,
            HEAD_DIM,
            BLOCK_SIZE,
            INT8,
            F32,
        )
        s = _dot(q, tl.trans(k), F32) * scale  # [BLOCK_M, BLOCK_N]
        if USE_SOFTCAP:
            s = _softcap(s, softcap)
        visible = tok_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - pos[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        if INT8:
            # Each key's value-row scale weights its probability: the int8 row itself is exact in q's dtype.
            v = tl.load(v_cache_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0)
            if F32:
                acc = acc * alpha[:, None] + _dot(p * v_scale[None, :], v.to(tl.float32), F32)
            else:
                acc = acc * alpha[:, None] + _dot((p * v_scale[None, :]).to(q.dtype), v.to(q.dtype), F32)
        else:
            v = tl.load(v_cache_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32)
        m = m_new

    o = acc / tl.where(row_ok, denom, 1.0)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_o_t + heads[:, None] * stride_o_h + dims[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )
