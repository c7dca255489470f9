"""Q8_0 repacked sixteen rows to a tile (`GGMLType.Q8_0_R16`): the layout's specification, and conversions both ways.

Rows are taken in tiles of `TILE_ROWS` (the last tile holds the rows left over, W < 16 of them). A tile of W rows
keeps each 32-element block of its rows together, 34 W bytes: the W rows' float16 scales (2 bytes each, in row
order), then their values as [8 groups of 4 elements][W rows][4 bytes], each byte q + 128 (q Q8_0's signed value).
Tile t starts at byte 16 t * row_bytes, where row 16 t starts in Q8_0: the tensor has exactly Q8_0's bytes.

Why: the CPU's int8 kernel (csrc/cpu_rows16.h) then loads four elements of sixteen rows as one 512-bit operand of
`vpdpbusd` (weights the unsigned operand, x's four bytes broadcast), so it sums sixteen outputs per instruction
with no horizontal sums: about the int8 peak from a few rows of x, where the row-major quad order reaches ~40%.
"""

from __future__ import annotations

import torch
from pagoda.pagedkernel.quant.formats import BLOCK_SIZES, GGMLType, QuantizedTensor
from torch import Tensor

TILE_ROWS = 16
_BLOCK = BLOCK_SIZES[GGMLType.Q8_0][1]  # 34 bytes: a float16 scale, 32 signed values
_VALUES = 32
# Rows converted per step: bounds the index tensors (rows x blocks x 34 int64) to tens of MB.
CHUNK_ROWS = 4096


def _offsets(lane: Tensor, width: Tensor) -> Tensor:  # int64 [m], [m] -> int64 [m, 34]
    """Where each byte of a row's Q8_0 block lies within its tile's block (row `lane` of a tile of `width` rows)."""
    lane, width = lane[:, None], width[:, None]
    scale = 2 * lane + torch.arange(2, device=lane.device)
    element = torch.arange(_VALUES, device=lane.device)
    values = 2 * width + (element // 4) * 4 * width + 4 * lane + element % 4
    return torch.cat((scale, values), dim=1)


def _positions(rows: Tensor, total_rows: int, blocks: int) -> Tensor:  # int64 [m] -> int64 [m, blocks, 34]
    """Byte positions in a Q8_0_R16 tensor of `total_rows` rows of each listed row's Q8_0 bytes, block by block."""
    tile, lane = rows // TILE_ROWS, rows % TILE_ROWS
    full = total_rows // TILE_ROWS
    width = torch.where(tile < full, TILE_ROWS, total_rows - full * TILE_ROWS)
    start = tile * TILE_ROWS * blocks * _BLOCK  # tile t begins where row 16 t does
    block = torch.arange(blocks, device=rows.device)[None, :, None] * _BLOCK * width[:, None, None]
    return start[:, None, None] + block + _offsets(lane, width)[:, None, :]


def _flip_values(blocks: Tensor) -> Tensor:  # uint8 [..., 34] -> uint8 [..., 34]
    """Q8_0's signed values <-> the layout's q + 128 (the same xor both ways); the scale bytes stay."""
    out = blocks.clone()
    out[..., 2:] ^= 0x80
    return out


def _check(weight: QuantizedTensor, qtype: GGMLType) -> Tensor:  # -> flat uint8 [nbytes]
    """The weight's bytes, flat, once its type is checked (ValueError naming the type otherwise)."""
    if weight.qtype is not qtype:
        raise ValueError(f"expected a {qtype.name} weight, got {weight.qtype.name}")
    return weight.data.reshape(-1)


def repack(weight: QuantizedTensor, *, in_place: bool = False) -> QuantizedTensor:
    """Q8_0 -> Q8_0_R16: a new tensor, or (in_place) the same bytes rewritten a chunk of rows at a time (no second
    copy of the weight, e.g. of a model's LM head at load)."""
    flat = _check(weight, GGMLType.Q8_0)
    rows, blocks = weight.rows, weight.shape[-1] // _VALUES
    out = flat if in_place else torch.empty_like(flat)
    for start in range(0, rows, CHUNK_ROWS):  # a multiple of the tile: chunks hold whole tiles
        stop = min(rows, start + CHUNK_ROWS)
        ids = torch.arange(start, stop, device=flat.device)
        src = flat[start * blocks * _BLOCK : stop * blocks * _BLOCK].reshape(stop - start, blocks, _BLOCK)
        out[_positions(ids, rows, blocks)] = _flip_values(src)
    data = out.reshape(weight.data.shape)
    return QuantizedTensor(data, GGMLType.Q8_0_R16, weight.shape)


def take_rows(weight: QuantizedTensor, ids: Tensor) -> QuantizedTensor:  # ids int64 [m]
    """Rows `ids` of a 2-D view of the weight as a [m, K] tensor of its format, or Q8_0's for a Q8_0_R16 weight
    (an embedding lookup, or a run of rows to dequantize)."""
    width = weight.shape[-1]
    if weight.qtype is not GGMLType.Q8_0_R16:
        picked = weight.data.reshape(weight.rows, -1).index_select(0, ids)  # uint8 [m, row_bytes]
        return QuantizedTensor(picked, weight.qtype, (int(ids.shape[0]), width))
    flat = weight.data.reshape(-1)
    blocks = width // _VALUES
    picked = _flip_values(flat[_positions(ids, weight.rows, blocks)])  # [m, blocks, 34]
    return QuantizedTensor(picked.reshape(int(ids.shape[0]), -1), GGMLType.Q8_0, (int(ids.shape[0]), width))


def unpack(weight: QuantizedTensor) -> QuantizedTensor:
    """Q8_0_R16 -> Q8_0 (a new tensor of the same shape)."""
    _check(weight, GGMLType.Q8_0_R16)
    parts = [
        take_rows(
            weight, torch.arange(start, min(weight.rows, start + CHUNK_ROWS), device=weight.data.device)
        ).data
        for start in range(0, weight.rows, CHUNK_ROWS)
    ]
    data = torch.cat(parts) if parts else weight.data.reshape(0, weight.row_bytes)
    return QuantizedTensor(data.reshape(weight.data.shape), GGMLType.Q8_0, weight.shape)
