"""exp and log in float32, written as one fixed sequence of IEEE float32 operations (the specification).

The sampler's result must be bitwise the same on every backend, so it cannot use the platform's `exp` and `log`
(torch's SLEEF, glibc, CUDA's libdevice all round differently). These are Cephes' `expf` and `logf` (within 2
ulp), spelled with `+`, `-`, `*`, `floor` and bit casts only: each of those is exactly rounded in IEEE float32,
so the C kernel (compiled with `-ffp-contract=off`, so that no multiply-add is fused) and the Triton kernels
(launched with `enable_fp_fusion=False`) compute the same bits as these torch ops, one operation at a time.
Constants are float32 values given in hex, so that no backend rounds a decimal literal differently.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG2E = float.fromhex("0x1.715476p+0")
LN2_HI = float.fromhex("0x1.63p-1")  # 0.693359375
LN2_LO = float.fromhex("-0x1.bd0106p-13")  # ln 2 - LN2_HI, rounded to float32
EXP_POLY = tuple(
    float.fromhex(h)
    for h in ("0x1.a0d2cep-13", "0x1.6e879cp-10", "0x1.11121p-7", "0x1.555382p-5", "0x1.555554p-3", "0x1p-1")
)
# exp32 returns 0 below this: the smallest result is then 2^-125 * 0.7, a normal float32 on every device
# (a denormal would be flushed to zero on some GPUs and kept on CPUs).
EXP_LO = -86.0
SQRT_HALF = float.fromhex("0x1.6a09e6p-1")
LOG_POLY = tuple(
    float.fromhex(h)
    for h in (
        "0x1.204376p-4",
        "-0x1.d7a37p-4",
        "0x1.de4a34p-4",
        "-0x1.fcba9ep-4",
        "0x1.23d37ep-3",
        "-0x1.555cap-3",
        "0x1.999d58p-3",
        "-0x1.fffff8p-3",
        "0x1.555554p-2",
    )
)


def exp32(x: Tensor) -> Tensor:  # float32, any shape; meant for x <= 0
    """exp(x) for x <= 0 (Cephes expf), 0 below EXP_LO; exp32(0) is exactly 1."""
    n = torch.floor(x * LOG2E + 0.5)
    r = x - n * LN2_HI
    r = r - n * LN2_LO
    z = r * r
    p = torch.full_like(r, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = p * r + c
    y = p * z + r + 1.0
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)  # 2^n, n in [-125, 0] here
    return torch.where(x < EXP_LO, 0.0, y * scale)


def log32(y: Tensor) -> Tensor:  # float32, any shape; y > 0 and normal
    """log(y) for positive normal float32 y (Cephes logf)."""
    bits = y.view(torch.int32)
    mantissa = ((bits & 0x007FFFFF) | 0x3F000000).view(torch.float32)  # in [0.5, 1)
    small = mantissa < SQRT_HALF
    e = ((bits >> 23) - 126 - small.to(torch.int32)).to(torch.float32)
    x = torch.where(small, mantissa + mantissa - 1.0, mantissa - 1.0)
    z = x * x
    p = torch.full_like(x, LOG_POLY[0])
    for c in LOG_POLY[1:]:
        p = p * x + c
    r = p * x * z
    r = r + e * LN2_LO
    r = r - 0.5 * z
    return x + r + e * LN2_HI
