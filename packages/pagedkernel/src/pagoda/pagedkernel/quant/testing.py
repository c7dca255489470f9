"""Random quantized weights for tests and benchmarks, the error bound of the int8-activation matmul, and the
worst-case and typical errors of a float32 one."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from pagoda.pagedkernel.quant import repack
from pagoda.pagedkernel.quant.formats import BLOCK_SIZES, GGMLType, QuantizedTensor
from torch import Tensor

# Byte offsets of each type's float16 scale fields (d, and the minimum or dmin where there is one).
HALF_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.I4_G64: (0, 2),
    GGMLType.I4_G128: (0, 2),
}


def random_weight(
    qtype: GGMLType,
    shape: tuple[int, ...],
    generator: torch.Generator,
    *,
    scale: float = 0.01,  # magnitude of the float16 scales; 0: every byte random
) -> QuantizedTensor:
    """Random blocks of `qtype` for a tensor of `shape`; the float16 scales are drawn in [scale/2, scale] with a
    random sign (scale=0: every byte random, so NaN, inf and subnormal halves occur too)."""
    if qtype in repack.SOURCE_OF:  # a layout of another format's blocks
        return repack.repack(random_weight(repack.SOURCE_OF[qtype], shape, generator, scale=scale))
    block, size = BLOCK_SIZES[qtype]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    num_blocks = rows * (shape[-1] // block)
    raw = torch.randint(0, 256, (num_blocks, size), dtype=torch.uint8, generator=generator)
    if scale:
        for at in HALF_FIELDS[qtype]:
            mags = torch.rand(num_blocks, generator=generator) * (scale / 2) + scale / 2
            signs = torch.randint(0, 2, (num_blocks,), generator=generator) * 2 - 1
            halves = (mags * signs).to(torch.float16).view(torch.uint8).reshape(num_blocks, 2)
            raw[:, at : at + 2] = halves
    return QuantizedTensor(raw.reshape(rows, -1) if len(shape) > 1 else raw.reshape(-1), qtype, shape)


def int8_error_bound(
    x: Tensor,  # [rows, K]
    w: Tensor,  # float [N, K], the exact dequantized weights
) -> Tensor:  # float64 [rows, N]
    """The most that quantizing x to int8 per 32 elements can move each output of x @ w^T, plus float32 rounding.

    x is rounded to dx * q with dx = max|x_block| / 127, so each element moves by at most dx / 2: an output moves
    by at most sum over blocks of dx / 2 * sum |w| over the block. The kernel's float32 products and sums (one per
    32 elements, then eight lanes) add at most ~K/32 + 16 roundings of relative 2^-24 of sum |x| |w|; 1e-4 of it
    covers K up to ~50,000.
    """
    rows, k = x.shape
    xb = x.to(torch.float64).reshape(rows, k // 32, 32)
    dx = xb.abs().amax(-1) / 127  # [rows, K / 32]
    wb = w.to(torch.float64).abs().reshape(w.shape[0], k // 32, 32).sum(-1)  # [N, K / 32]
    rounding = x.to(torch.float64).abs() @ w.to(torch.float64).abs().t()
    return (dx / 2) @ wb.t() + 1e-4 * rounding


def float32_error_bound(
    x: Tensor,  # [rows, K]
    w: Tensor,  # float [N, K], the weights the kernel multiplies (exact, or rounded to bfloat16 first)
) -> Tensor:  # float64 [rows, N]
    """The most any float32 evaluation of x @ w^T can be off, in any summation order and with or without fused
    multiply-adds: gamma_K * sum |x| |w| (Higham's bound, gamma_K = K u / (1 - K u), u = 2^-24), plus the smallest
    subnormal for products a bfloat16 dot product flushes to zero."""
    k = x.shape[-1]
    u = 2.0**-24
    magnitudes = x.to(torch.float64).abs() @ w.to(torch.float64).abs().t()
    return k * u / (1 - k * u) * magnitudes + k * 2.0**-126


def float32_typical_error(
    got: Tensor,  # [rows, N]
    x: Tensor,  # [rows, K]
    w: Tensor,  # float [N, K], the weights the kernel multiplies
    reference: Tensor | None = None,  # [rows, N]; default the exact (float64) x @ w^T
) -> float:
    """The typical error of a float32 evaluation of x @ w^T, in units of its expected size u sqrt(K) (u = 2^-24):
    RMS over the outputs of (got - reference), over u sqrt(K) times the RMS over the outputs of ||x_r * w_j||_2
    (the 2-norm of each output's K products). At most 1 for one float32 evaluation against the exact product,
    2 for two evaluations (e.g. the kernel against torch's float32 matmul), for the inputs the tests draw.

    Why: each of the <= 2K roundings of a dot product (K products, unless fused into an FMA, and K - 1 sums)
    adds delta_j s_j, with s_j the value rounded and |delta_j| <= u. In the standard probabilistic model (Higham and
    Mary, 2019) the delta_j are independent with mean zero, so E[err^2] <= u^2 sum_j E[s_j^2]. x has zero mean and
    independent elements (or w does: random weights), so the products are uncorrelated with mean zero, and any
    partial sum over a set S of them (a summation order is fixed whatever the values) has
    E[s_S^2] = sum over S of E[p_i^2]. Each product is in at most K of the rounded values (itself and the sums that
    contain it, in the worst order: one long sequential sum), so sum_j E[s_j^2] <= K E[||p||^2], and
    RMS(err) <= u sqrt(K) RMS(||p||). (Averaged over outputs the measured RMS is ~0.3 of it: blocked and lane-wise
    sums hold shorter partial sums than the sequential worst case.) The worst case, `float32_error_bound`, is
    ~sqrt(K) ||p||_1 / ||p||_2 ~ K times larger: it cannot see a kernel that is wrong in the 5th digit everywhere,
    which this does.
    """
    k = x.shape[-1]
    xd, wd = x.to(torch.float64), w.to(torch.float64)
    want = xd @ wd.t() if reference is None else reference.to(torch.float64)
    error_rms = float((got.to(torch.float64) - want).pow(2).mean().sqrt())
    products_rms = float(((xd * xd) @ (wd * wd).t()).mean().sqrt())  # mean over outputs of ||p||^2, rooted
    return error_rms / (2.0**-24 * math.sqrt(k) * products_rms)


def outputs_on_threads(
    run: Callable[[Tensor], None], shape: tuple[int, int], counts: tuple[int, ...] = (1, 2)
) -> list[Tensor]:  # float32 [*shape] per count
    """run(out) into a NaN-filled float32 out once per torch thread count in `counts` (restored after): the kernels
    compute each output whole on one thread, so the results should be equal bit for bit."""
    before = torch.get_num_threads()
    outs = []
    try:
        for count in counts:
            torch.set_num_threads(count)
            out = torch.full(shape, float("nan"))
            run(out)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    return outs


def assert_bit_exact(got: Tensor, expected: Tensor) -> None:
    """Same float32 bits everywhere, except that NaNs need only be NaN on both sides (payloads may differ)."""
    assert got.dtype == expected.dtype == torch.float32, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan), "NaN in different places"
    assert torch.equal(got.view(torch.int32)[~nan], expected.view(torch.int32)[~nan]), "different bits"
