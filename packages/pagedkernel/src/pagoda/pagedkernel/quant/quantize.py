"""Quantize float weights into block formats (for `--quantization int8|int4` at load): the torch specification.

Q8_0 and Q4_1 give byte for byte the blocks gguf's reference quantizer (`gguf.quants.quantize`, after ggml's
`quantize_row_q8_0` / `quantize_row_q4_1_ref`) writes for the same float32 values (tested); Pagoda's int4 group
formats (I4_G64, I4_G128) run Q4_1's rule over their larger groups.
"""

from __future__ import annotations

import torch
from pagoda.pagedkernel.quant.formats import BLOCK_SIZES, GGMLType, QuantizedTensor
from torch import Tensor

# The formats `quantize` writes, and the int4 one of each group size.
QUANTIZABLE = frozenset({GGMLType.Q8_0, GGMLType.Q4_1, GGMLType.I4_G64, GGMLType.I4_G128})
INT4_BY_GROUP: dict[int, GGMLType] = {32: GGMLType.Q4_1, 64: GGMLType.I4_G64, 128: GGMLType.I4_G128}


def _f16_bytes(v: Tensor) -> Tensor:  # float32 [num_blocks, 1] -> uint8 [num_blocks, 2]
    return v.to(torch.float16).view(torch.uint8)


def _q8_0(blocks: Tensor) -> Tensor:  # float32 [num_blocks, 32] -> uint8 [num_blocks, 34]
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    # Half away from zero, as ggml's roundf (torch.round rounds half to even).
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return torch.cat((_f16_bytes(d), q.to(torch.int8).view(torch.uint8)), dim=1)


def _affine4(blocks: Tensor) -> Tensor:  # float32 [num_blocks, group] -> uint8 [num_blocks, 4 + group / 2]
    """Q4_1's rule over a group: d = (max - min) / 15, q = trunc((w - min) / d + 0.5) clipped to 0..15."""
    group = blocks.shape[1]
    high, low = blocks.amax(dim=1, keepdim=True), blocks.amin(dim=1, keepdim=True)
    d = (high - low) / 15
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((blocks - low) * inverse + 0.5).clamp(0, 15).to(torch.uint8)
    # Per 32 values: byte j holds value j in its low nibble and value 16 + j in its high one.
    q = q.reshape(-1, group // 32, 2, 16)
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, group // 2)
    return torch.cat((_f16_bytes(d), _f16_bytes(low), packed), dim=1)


def quantize(weight: Tensor, qtype: GGMLType) -> QuantizedTensor:  # float [N, K], K a multiple of the block
    """`weight`'s float32 values in `qtype`'s blocks; ValueError for a format not in QUANTIZABLE or a ragged K."""
    if qtype not in QUANTIZABLE:
        names = ", ".join(sorted(t.name for t in QUANTIZABLE))
        raise ValueError(f"cannot quantize into {qtype.name}: quantize writes {names}")
    if weight.dim() != 2:
        raise ValueError(f"quantize takes a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    rows, k = (int(d) for d in weight.shape)
    block, _ = BLOCK_SIZES[qtype]
    if k % block:
        raise ValueError(f"{qtype.name} stores rows in blocks of {block}; rows of {k} are not whole blocks")
    blocks = weight.detach().to(torch.float32).reshape(-1, block)  # [N * K / block, block]
    raw = _q8_0(blocks) if qtype == GGMLType.Q8_0 else _affine4(blocks)
    return QuantizedTensor(raw.reshape(rows, -1).contiguous(), qtype, (rows, k))
