"""The specification of the quantized ops, in torch: dequantize each GGUF block format, and matmul through it.

Every float operation is the one gguf's reference (`gguf.quants`, after ggml's `dequantize_row_*`) performs, in
the same order, so the values are bit-exact (tested); the C backend (`cpu_quant.c`) repeats them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pagoda.pagedkernel.quant import repack
from pagoda.pagedkernel.quant.formats import QK_K, GGMLType, QuantizedTensor
from torch import Tensor


def _f16(raw: Tensor) -> Tensor:  # uint8 [num_blocks, 2] -> float32 [num_blocks, 1]
    """Little-endian float16 bytes as float32 (exact)."""
    return raw.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: Tensor) -> Tensor:  # uint8 [num_blocks, groups, n] -> uint8 [num_blocks, groups, 2 * n]
    """Each byte's low nibbles, then its high nibbles: element j is byte j's low half, element n + j its high."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(
    qh: Tensor, count: int
) -> Tensor:  # uint8 [num_blocks, 4] (a little-endian uint32) -> uint8 [num_blocks, count]
    """Bit j of the 32-bit word, for j < count."""
    word = qh.to(torch.int64)
    word = word[:, 0] | word[:, 1] << 8 | word[:, 2] << 16 | word[:, 3] << 24
    shifts = torch.arange(count, dtype=torch.int64, device=qh.device)
    return ((word.unsqueeze(1) >> shifts) & 1).to(torch.uint8)


def _q4_0(b: Tensor) -> Tensor:  # uint8 [num_blocks, 18] -> float32 [num_blocks, 32]
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, None, 2:18])[:, 0].to(torch.int8) - 8
    return d * q.to(torch.float32)


def _q4_1(b: Tensor) -> Tensor:  # uint8 [num_blocks, 20] -> float32 [num_blocks, 32]
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, None, 4:20])[:, 0].to(torch.float32)
    return d * q + m


def _i4_group(
    b: Tensor, group: int
) -> Tensor:  # uint8 [num_blocks, 4 + group / 2] -> float32 [num_blocks, group]
    """Pagoda's int4 group format: d * q + m, q in Q4_1's nibble order per 32 values."""
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:].reshape(-1, group // 32, 16)).reshape(-1, group).to(torch.float32)
    return d * q + m


def _q5(b: Tensor, first: int) -> Tensor:  # uint8 [num_blocks, type_size] -> uint8 [num_blocks, 32], 0..31
    """The 5-bit values of a Q5_0 / Q5_1 block whose high-bit word starts at byte `first`."""
    low = _nibbles(b[:, None, first + 4 : first + 20])[:, 0]
    return low | (_bits(b[:, first : first + 4], 32) << 4)


def _q5_0(b: Tensor) -> Tensor:  # uint8 [num_blocks, 22] -> float32 [num_blocks, 32]
    d = _f16(b[:, 0:2])
    return d * (_q5(b, 2).to(torch.int8) - 16).to(torch.float32)


def _q5_1(b: Tensor) -> Tensor:  # uint8 [num_blocks, 24] -> float32 [num_blocks, 32]
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return d * _q5(b, 4).to(torch.float32) + m


def _q8_0(b: Tensor) -> Tensor:  # uint8 [num_blocks, 34] -> float32 [num_blocks, 32]
    d = _f16(b[:, 0:2])
    return b[:, 2:34].contiguous().view(torch.int8).to(torch.float32) * d


def k_scales(scales: Tensor) -> tuple[Tensor, Tensor]:  # uint8 [num_blocks, 12] -> 2 x uint8 [num_blocks, 8]
    """The eight 6-bit scales and eight 6-bit mins packed in a Q4_K / Q5_K block's 12 scale bytes."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mins


def _k_affine(b: Tensor, q: Tensor) -> Tensor:  # q: float32 [num_blocks, 8, 32] -> float32 [num_blocks, 256]
    """(d * scale) * q - dmin * min per 32-element sub-block of a Q4_K / Q5_K block."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mins = k_scales(b[:, 4:16])
    scale = (d * sc.to(torch.float32)).unsqueeze(-1)
    offset = (dmin * mins.to(torch.float32)).unsqueeze(-1)
    return (scale * q - offset).reshape(-1, QK_K)


def _q4_k(b: Tensor) -> Tensor:  # uint8 [num_blocks, 144] -> float32 [num_blocks, 256]
    # Four 32-byte groups: the low nibbles are sub-block 2g, the high nibbles sub-block 2g + 1.
    q = _nibbles(b[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return _k_affine(b, q.to(torch.float32))


def _q5_k(b: Tensor) -> Tensor:  # uint8 [num_blocks, 176] -> float32 [num_blocks, 256]
    low = _nibbles(b[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
    high = (b[:, None, 16:48] >> shifts) & 1  # bit s of byte j: sub-block s, element j
    return _k_affine(b, (low | (high << 4)).to(torch.float32))


def _q6_k(b: Tensor) -> Tensor:  # uint8 [num_blocks, 210] -> float32 [num_blocks, 256]
    # Two halves of 128: low nibbles of 64 bytes (elements 0..63 low, 64..127 high), 2 high bits from 32 bytes.
    low = _nibbles(b[:, 0:128].reshape(-1, 2, 64)).reshape(-1, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    high = (b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3
    q = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32).reshape(-1, 16, 16)
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(b[:, 208:210])
    return ((d * scales).unsqueeze(-1) * q).reshape(-1, QK_K)


DECODERS: dict[GGMLType, Callable[[Tensor], Tensor]] = {
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
    GGMLType.I4_G64: lambda b: _i4_group(b, 64),
    GGMLType.I4_G128: lambda b: _i4_group(b, 128),
}


def dequantize(weight: QuantizedTensor) -> Tensor:  # float32 weight.shape
    """The float32 values `weight`'s blocks encode (the specification; a repacked layout through its rows)."""
    if weight.qtype in repack.SOURCE_OF:
        return dequantize(repack.unpack(weight))
    return DECODERS[weight.qtype](weight.blocks()).reshape(weight.shape)


def qmatmul(
    x: Tensor,  # [rows, K]
    weight: QuantizedTensor,  # [N, K]
) -> Tensor:  # float32 [rows, N]
    """x @ W^T in float32, W dequantized first (the reference every quantized matmul is measured against)."""
    return x.to(torch.float32) @ dequantize(weight).t()
