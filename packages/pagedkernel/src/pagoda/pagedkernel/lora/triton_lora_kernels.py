# The kernels are Triton IR, not typed Python: their arguments are pointers, scalars and constexprs.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
"""Triton kernels of the LoRA ops: one program per (row, tile of outputs); a row without an adapter does no work."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def shrink_kernel(
    x_ptr,
    x_stride,
    a_ptr,
    slots_ptr,
    scales_ptr,
    h_ptr,
    rank,
    in_features,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """h[t, r-tile] = scale[s] * x[t] @ a[s, r-tile]^T in float32 (h is zero-filled by the launcher)."""
    t = tl.program_id(0)
    r_offs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        a_base = a_ptr + slot * rank * in_features
        for k0 in range(0, in_features, BLOCK_K):
            k_offs = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + t * x_stride + k_offs, mask=k_offs < in_features, other=0.0).to(tl.float32)
            tile_mask = (r_offs[:, None] < rank) & (k_offs[None, :] < in_features)
            ak = tl.load(
                a_base + r_offs[:, None] * in_features + k_offs[None, :], mask=tile_mask, other=0.0
            ).to(tl.float32)
            acc += tl.sum(ak * xk[None, :], axis=1)
        scale = tl.load(scales_ptr + slot)
        tl.store(h_ptr + t * rank + r_offs, acc * scale, mask=r_offs < rank)


@triton.jit
def expand_kernel(
    h_ptr,
    b_ptr,
    slots_ptr,
    y_ptr,
    y_stride,
    offset,
    out_features,
    rank,
    b_stride_n,
    b_stride_r,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """y[t, offset + n-tile] += h[t] @ b[s, n-tile]^T, summed in float32 and rounded once (B's strides within a
    slot are given: output-major or rank-major)."""
    t = tl.program_id(0)
    n_offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        r_offs = tl.arange(0, BLOCK_R)
        ht = tl.load(h_ptr + t * rank + r_offs, mask=r_offs < rank, other=0.0)
        tile_mask = (n_offs[:, None] < out_features) & (r_offs[None, :] < rank)
        bt = tl.load(
            b_ptr + slot * out_features * rank + n_offs[:, None] * b_stride_n + r_offs[None, :] * b_stride_r,
            mask=tile_mask,
            other=0.0,
        ).to(tl.float32)
        delta = tl.sum(bt * ht[None, :], axis=1)
        y_at = y_ptr + t * y_stride + offset + n_offs
        n_mask = n_offs < out_features
        yv = tl.load(y_at, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_at, (yv + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def embedding_shrink_kernel(
    ids_ptr,
    a_ptr,
    slots_ptr,
    scales_ptr,
    h_ptr,
    rank,
    vocab,
    BLOCK_R: tl.constexpr,
):
    """h[t] = scale[s] * a[s, ids[t]] (a gathered row of A transposed; h is zero-filled by the launcher)."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        r_offs = tl.arange(0, BLOCK_R)
        token = tl.load(ids_ptr + t)
        row = tl.load(a_ptr + (slot * vocab + token) * rank + r_offs, mask=r_offs < rank, other=0.0)
        scale = tl.load(scales_ptr + slot)
        tl.store(h_ptr + t * rank + r_offs, row.to(tl.float32) * scale, mask=r_offs < rank)
