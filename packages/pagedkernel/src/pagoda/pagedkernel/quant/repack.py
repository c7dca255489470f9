"""Q8_0, Q4_1, Q5_0, Q4_K and Q6_K repacked sixteen rows to a tile (`Q8_0_R16`, `Q4_1_R16`, `Q5_0_R16`, `Q4_K_R16`,
`Q6_K_R16`): the layouts' specification, and conversions both ways.

Rows are taken in tiles of `TILE_ROWS` (the last tile holds the rows left over, W < 16 of them). A tile of W rows
keeps each 32-element block of its rows together, W times the source format's bytes per block: the W rows' float16
scales d in row order (Q4_1: then their minima m), then the unsigned values u of element 4 g + e (group g = 0..7,
e = 0..3) of each row c:
  - Q8_0: bytes u = q + 128 (q the signed value) as [8 groups][W rows][4];
  - Q4_1 (u the nibble) and Q5_0 (u the 5-bit value q + 16): bytes [4 pairs p][W rows][4] holding u & 15 of group
    2 p in the low nibble and of group 2 p + 1 in the high one; Q5_0 then 4 W bytes of fifth bits, bit
    (g W + c) 4 + e of the little-endian bit string being bit 4 of that u.
`Q4_K_R16` keeps each 256-element super-block of the W rows together instead (W times Q4_K's 144 bytes): the W rows'
float16 d, then their float16 dmin, then W bytes per sub-block j = 0..7 ([8][W]) holding the low four bits of the
6-bit scale sc_j (low nibble) and of the 6-bit minimum m_j (high nibble), then one little-endian 32-bit word per row
with their high two bits (sc_j's at bit 2 j, m_j's at bit 16 + 2 j), then each 32-element sub-block's nibbles u as
Q4_1's values above. Its value is (d sc_j) u - dmin m_j, as Q4_K's. `Q6_K_R16` (W times Q6_K's 210 bytes per
super-block): the W rows' float16 d, their signed 8-bit scales as [16 sub-blocks of 16][W], then per 32-element block
(elements 32 j.. of the super-block in ggml's order) its values' low four bits as Q4_1's values above, then 8 W bytes
[2 quads of groups][W rows][4] whose bits 2 i hold the high two bits of group 4 quad + i's element; u = q + 32, the
value (d sc) (u - 32) with each 16 elements' own sc.
Tile t starts at byte 16 t * row_bytes, where row 16 t starts in the source format: the same bytes in all.

Why: the CPU's int8 kernel (csrc/cpu_rows16.h) then loads four elements of sixteen rows as one 512-bit operand of
`vpdpbusd` (the values the unsigned operand, x's four bytes broadcast), so it sums sixteen outputs per instruction
with no horizontal sums: about the int8 peak from a few rows of x, where the row-major quad order reaches ~40%.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pagoda.pagedkernel.quant.formats import BLOCK_SIZES, GGMLType, QuantizedTensor
from torch import Tensor

TILE_ROWS = 16
_VALUES = 32
# Each repacked layout and the format whose blocks it holds.
LAYOUT_OF: dict[GGMLType, GGMLType] = {
    GGMLType.Q8_0: GGMLType.Q8_0_R16,
    GGMLType.Q4_1: GGMLType.Q4_1_R16,
    GGMLType.Q5_0: GGMLType.Q5_0_R16,
    GGMLType.Q4_K: GGMLType.Q4_K_R16,
    GGMLType.Q6_K: GGMLType.Q6_K_R16,
}
SOURCE_OF: dict[GGMLType, GGMLType] = {layout: source for source, layout in LAYOUT_OF.items()}
# Rows converted per step: bounds the temporaries to tens of MB (a multiple of the tile).
CHUNK_ROWS = 4096
_BIT = torch.arange(8, dtype=torch.uint8)


def _halves(qtype: GGMLType) -> int:
    """Bytes of float16 fields per row and block (d, and Q4_1's m)."""
    return 4 if qtype is GGMLType.Q4_1 else 2


def _decode(
    qtype: GGMLType, blocks: Tensor
) -> tuple[Tensor, Tensor]:  # uint8 [..., size] -> [..., H], [..., 32]
    """A source block's float16 bytes and its 32 unsigned values u."""
    h = _halves(qtype)
    if qtype is GGMLType.Q8_0:
        return blocks[..., :h], blocks[..., h:] ^ 0x80
    nibbles = blocks[..., -16:]
    u = torch.cat((nibbles & 15, nibbles >> 4), dim=-1)
    if qtype is GGMLType.Q5_0:
        qh = blocks[..., h : h + 4]  # bit j of the little-endian word: bit 4 of element j
        fifth = (qh.unsqueeze(-1) >> _BIT.to(qh.device)) & 1  # [..., 4, 8]
        u = u | (fifth.flatten(-2) << 4)
    return blocks[..., :h], u


def _encode(qtype: GGMLType, halves: Tensor, u: Tensor) -> Tensor:  # [..., H], [..., 32] -> uint8 [..., size]
    """The source block of float16 bytes and values (the inverse of `_decode`)."""
    if qtype is GGMLType.Q8_0:
        return torch.cat((halves, u ^ 0x80), dim=-1)
    nibbles = (u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)
    if qtype is GGMLType.Q4_1:
        return torch.cat((halves, nibbles), dim=-1)
    qh = ((u >> 4).reshape(*u.shape[:-1], 4, 8) << _BIT.to(u.device)).sum(-1, dtype=torch.uint8)
    return torch.cat((halves, qh, nibbles), dim=-1)


def _tiles(
    qtype: GGMLType, halves: Tensor, u: Tensor
) -> Tensor:  # [T, W, B, H], [T, W, B, 32] -> [T, B, W size]
    """Tiles of W rows laid out as the module docstring says."""
    t, w, b, h = halves.shape
    head = halves.reshape(t, w, b, h // 2, 2).permute(0, 2, 3, 1, 4).reshape(t, b, h * w)
    values = u.reshape(t, w, b, 8, 4).permute(0, 2, 3, 1, 4)  # [T, B, 8 groups, W, 4]
    if qtype is GGMLType.Q8_0:
        return torch.cat((head, values.reshape(t, b, 32 * w)), dim=-1)
    low = (values & 15).reshape(t, b, 4, 2, w, 4)
    pairs = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(t, b, 16 * w)
    if qtype is GGMLType.Q4_1:
        return torch.cat((head, pairs), dim=-1)
    bits = (values >> 4).reshape(t, b, 4 * w, 8)
    packed = (bits << _BIT.to(u.device)).sum(-1, dtype=torch.uint8)
    return torch.cat((head, pairs, packed), dim=-1)


def _untiles(qtype: GGMLType, tiles: Tensor, w: int) -> tuple[Tensor, Tensor]:  # [T, B, W size] -> halves, u
    """The inverse of `_tiles`: [T, W, B, H] float16 bytes and [T, W, B, 32] values."""
    t, b, _ = tiles.shape
    h = _halves(qtype)
    halves = tiles[..., : h * w].reshape(t, b, h // 2, w, 2).permute(0, 3, 1, 2, 4).reshape(t, w, b, h)
    rest = tiles[..., h * w :]
    if qtype is GGMLType.Q8_0:
        values = rest.reshape(t, b, 8, w, 4)
    else:
        pairs = rest[..., : 16 * w].reshape(t, b, 4, 1, w, 4)
        values = torch.cat((pairs & 15, pairs >> 4), dim=3).reshape(t, b, 8, w, 4)
        if qtype is GGMLType.Q5_0:
            packed = rest[..., 16 * w :]
            bits = ((packed.unsqueeze(-1) >> _BIT.to(tiles.device)) & 1).reshape(t, b, 8, w, 4)
            values = values | (bits << 4)
    return halves, values.permute(0, 3, 1, 2, 4).reshape(t, w, b, _VALUES)


def _q4k_fields(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # uint8 [..., 144] -> see below
    """A Q4_K block's four float16 bytes (d, dmin), its eight 6-bit scales then eight 6-bit minima [..., 16], and its
    values u [..., 8 sub-blocks, 32]."""
    from pagoda.pagedkernel.quant.torch_quant import k_scales  # the specification's unpacking (it imports us)

    sc, mins = k_scales(blocks[..., 4:16].reshape(-1, 12))
    scales = torch.cat((sc, mins), dim=-1).reshape(*blocks.shape[:-1], 16)
    nibbles = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 32)  # low nibbles: sub-block 2 g, high: 2 g + 1
    u = torch.stack((nibbles & 15, nibbles >> 4), dim=-2).reshape(*blocks.shape[:-1], 8, 32)
    return blocks[..., :4], scales, u


def _q4k_block(halves: Tensor, scales: Tensor, u: Tensor) -> Tensor:  # the inverse of `_q4k_fields`
    """Q4_K blocks [..., 144] from their float16 bytes, scales and minima, and values."""
    sc, mins = scales[..., :8], scales[..., 8:]
    packed = torch.cat(
        (
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            mins[..., :4] | ((mins[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((mins[..., 4:] & 15) << 4),
        ),
        dim=-1,
    )
    pairs = u.reshape(*u.shape[:-2], 4, 2, 32)
    return torch.cat((halves, packed, (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).flatten(-2)), dim=-1)


def _q4k_tiles(blocks: Tensor) -> Tensor:  # uint8 [T, W, B, 144] -> [T, B, 144 W]
    """Tiles of W rows of Q4_K blocks laid out as `Q4_K_R16`."""
    t, w, b, _ = blocks.shape
    halves, scales, u = _q4k_fields(blocks)
    head = (
        halves.reshape(t, w, b, 2, 2).permute(0, 2, 3, 1, 4).reshape(t, b, 4 * w)
    )  # d of each row, then dmin
    low = ((scales[..., :8] & 15) | ((scales[..., 8:] & 15) << 4)).permute(0, 2, 3, 1).reshape(t, b, 8 * w)
    shifts = torch.arange(0, 16, 2, dtype=torch.int64, device=blocks.device)
    high = ((scales[..., :8] >> 4).to(torch.int64) << shifts) | (
        (scales[..., 8:] >> 4).to(torch.int64) << (shifts + 16)
    )
    words = high.sum(-1)  # [T, W, B]: the bits do not overlap
    word_bytes = torch.stack([(words >> (8 * i)) & 255 for i in range(4)], dim=-1).to(torch.uint8)
    values = u.reshape(t, w, b, 8, 4, 2, 4).permute(0, 2, 3, 4, 1, 5, 6)  # [T, B, sub, pair, W, 2 groups, 4]
    pairs = values[..., 0, :] | (values[..., 1, :] << 4)
    parts = (head, low, word_bytes.permute(0, 2, 1, 3).reshape(t, b, 4 * w), pairs.reshape(t, b, 128 * w))
    return torch.cat(parts, dim=-1)


def _q4k_untiles(tiles: Tensor, w: int) -> Tensor:  # uint8 [T, B, 144 W] -> [T, W, B, 144]
    """The inverse of `_q4k_tiles`."""
    t, b, _ = tiles.shape
    halves = tiles[..., : 4 * w].reshape(t, b, 2, w, 2).permute(0, 3, 1, 2, 4).reshape(t, w, b, 4)
    low = tiles[..., 4 * w : 12 * w].reshape(t, b, 8, w).permute(0, 3, 1, 2)  # [T, W, B, 8]
    words = tiles[..., 12 * w : 16 * w].reshape(t, b, w, 4).permute(0, 2, 1, 3).to(torch.int64)
    word = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)
    shifts = torch.arange(0, 16, 2, dtype=torch.int64, device=tiles.device)
    sc = (low & 15) | (((word[..., None] >> shifts) & 3) << 4).to(torch.uint8)
    mins = (low >> 4) | (((word[..., None] >> (shifts + 16)) & 3) << 4).to(torch.uint8)
    pairs = tiles[..., 16 * w :].reshape(t, b, 8, 4, 1, w, 4)
    values = torch.cat((pairs & 15, pairs >> 4), dim=4)  # [T, B, sub, pair, 2, W, 4]
    u = values.permute(0, 5, 1, 2, 3, 4, 6).reshape(t, w, b, 8, 32)
    return _q4k_block(halves, torch.cat((sc, mins), dim=-1), u)


def _q6k_fields(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # uint8 [..., 210] -> see below
    """A Q6_K block's float16 bytes d [..., 2], its sixteen scale bytes, and its values u = q + 32 [..., 8 blocks,
    32] in element order (ggml's: per half of 128, quarter l's elements are the low nibbles of ql's first 32 bytes,
    then of its next 32, then their high nibbles, with qh's bits 2 l)."""
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 2, 32)  # [half, 32-byte run, 32]
    low = torch.cat((ql & 15, ql >> 4), dim=-2)  # [half, quarter, 32]
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    high = torch.cat([(qh >> (2 * q)) & 3 for q in range(4)], dim=-2)
    return blocks[..., 208:210], blocks[..., 192:208], (low | (high << 4)).reshape(*lead, 8, 32)


def _q6k_block(d: Tensor, scales: Tensor, u: Tensor) -> Tensor:  # the inverse of `_q6k_fields`
    """Q6_K blocks [..., 210] from their float16 bytes, scale bytes and values."""
    lead = u.shape[:-2]
    quarters = u.reshape(*lead, 2, 4, 32)
    low, high = quarters & 15, quarters >> 4
    ql = (low[..., 0:2, :] | (low[..., 2:4, :] << 4)).reshape(*lead, 128)
    qh = (high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)).reshape(
        *lead, 64
    )
    return torch.cat((ql, qh, scales, d), dim=-1)


def _q6k_tiles(blocks: Tensor) -> Tensor:  # uint8 [T, W, B, 210] -> [T, B, 210 W]
    """Tiles of W rows of Q6_K blocks laid out as `Q6_K_R16`."""
    t, w, b, _ = blocks.shape
    d, scales, u = _q6k_fields(blocks)
    head = d.permute(0, 2, 1, 3).reshape(t, b, 2 * w)
    scale_rows = scales.permute(0, 2, 3, 1).reshape(t, b, 16 * w)
    values = u.reshape(t, w, b, 8, 8, 4).permute(0, 2, 3, 4, 1, 5)  # [T, B, block, group, W, 4]
    low = (values & 15).reshape(t, b, 8, 4, 2, w, 4)
    pairs = (low[:, :, :, :, 0] | (low[:, :, :, :, 1] << 4)).reshape(t, b, 8, 16 * w)
    high = (values >> 4).reshape(t, b, 8, 2, 4, w, 4)
    quads = (
        high[:, :, :, :, 0]
        | (high[:, :, :, :, 1] << 2)
        | (high[:, :, :, :, 2] << 4)
        | (high[:, :, :, :, 3] << 6)
    )
    blocks_out = torch.cat((pairs, quads.reshape(t, b, 8, 8 * w)), dim=-1).reshape(t, b, 192 * w)
    return torch.cat((head, scale_rows, blocks_out), dim=-1)


def _q6k_untiles(tiles: Tensor, w: int) -> Tensor:  # uint8 [T, B, 210 W] -> [T, W, B, 210]
    """The inverse of `_q6k_tiles`."""
    t, b, _ = tiles.shape
    d = tiles[..., : 2 * w].reshape(t, b, w, 2).permute(0, 2, 1, 3)
    scales = tiles[..., 2 * w : 18 * w].reshape(t, b, 16, w).permute(0, 3, 1, 2)
    blocks = tiles[..., 18 * w :].reshape(t, b, 8, 24 * w)
    pairs = blocks[..., : 16 * w].reshape(t, b, 8, 4, 1, w, 4)
    low = torch.cat((pairs & 15, pairs >> 4), dim=4).reshape(t, b, 8, 8, w, 4)
    quads = blocks[..., 16 * w :].reshape(t, b, 8, 2, 1, w, 4)
    high = torch.cat([(quads >> (2 * i)) & 3 for i in range(4)], dim=4).reshape(t, b, 8, 8, w, 4)
    u = (low | (high << 4)).permute(0, 4, 1, 2, 3, 5).reshape(t, w, b, 8, 32)
    return _q6k_block(d, scales, u)


# The super-block formats' conversions to tiles and back.
_SUPER_BLOCKS: dict[GGMLType, tuple[Callable[[Tensor], Tensor], Callable[[Tensor, int], Tensor]]] = {
    GGMLType.Q4_K: (_q4k_tiles, _q4k_untiles),
    GGMLType.Q6_K: (_q6k_tiles, _q6k_untiles),
}


def _checked(
    weight: QuantizedTensor, allowed: dict[GGMLType, GGMLType]
) -> Tensor:  # -> uint8 [rows, row_bytes]
    """The weight's bytes as rows, once its type is checked (ValueError naming the types otherwise)."""
    if weight.qtype not in allowed:
        names = ", ".join(t.name for t in allowed)
        raise ValueError(f"expected a weight of {names}, got {weight.qtype.name}")
    return weight.data.reshape(weight.rows, weight.row_bytes)


def _convert(rows: Tensor, source: GGMLType, to_tiles: bool) -> Tensor:  # uint8 [m, row_bytes] -> the same
    """m consecutive rows from tile 0 (m a multiple of 16, or the weight's last rows) converted to tiles or back."""
    m, row_bytes = rows.shape
    size = BLOCK_SIZES[source][1]
    blocks = row_bytes // size
    whole = m // TILE_ROWS * TILE_ROWS
    out = []
    for start, stop, w in ((0, whole, TILE_ROWS), (whole, m, m - whole)):  # the whole tiles, then a short one
        if stop == start:
            continue
        part, count = rows[start:stop], (stop - start) // w
        if source in _SUPER_BLOCKS:
            tiles, untiles = _SUPER_BLOCKS[source]
            shaped = (
                part.reshape(count, w, blocks, size) if to_tiles else part.reshape(count, blocks, w * size)
            )
            converted = tiles(shaped) if to_tiles else untiles(shaped, w)
            out.append(converted.reshape(stop - start, row_bytes))
        elif to_tiles:
            halves, u = _decode(source, part.reshape(count, w, blocks, size))
            out.append(_tiles(source, halves, u).reshape(stop - start, row_bytes))
        else:
            halves, u = _untiles(source, part.reshape(count, blocks, w * size), w)
            out.append(_encode(source, halves, u).reshape(stop - start, row_bytes))
    return torch.cat(out) if out else rows.clone()


def repack(weight: QuantizedTensor, *, in_place: bool = False) -> QuantizedTensor:
    """Q8_0 / Q4_1 / Q5_0 / Q4_K / Q6_K -> its `_R16` layout: a new tensor, or (in_place) the same bytes rewritten a chunk of rows
    at a time (no second copy of the weight, e.g. of a model's LM head at load)."""
    rows = _checked(weight, LAYOUT_OF)
    out = rows if in_place else torch.empty_like(rows)
    for start in range(0, weight.rows, CHUNK_ROWS):  # chunks of whole tiles
        stop = min(weight.rows, start + CHUNK_ROWS)
        out[start:stop] = _convert(rows[start:stop], weight.qtype, to_tiles=True)
    return QuantizedTensor(out.reshape(weight.data.shape), LAYOUT_OF[weight.qtype], weight.shape)


def unpack(weight: QuantizedTensor) -> QuantizedTensor:
    """A `_R16` layout -> its source format (a new tensor of the same shape)."""
    rows = _checked(weight, SOURCE_OF)
    source = SOURCE_OF[weight.qtype]
    out = torch.empty_like(rows)
    for start in range(0, weight.rows, CHUNK_ROWS):
        stop = min(weight.rows, start + CHUNK_ROWS)
        out[start:stop] = _convert(rows[start:stop], source, to_tiles=False)
    return QuantizedTensor(out.reshape(weight.data.shape), source, weight.shape)


def _q8_0_positions(
    ids: Tensor, total_rows: int, blocks: int
) -> Tensor:  # int64 [m] -> int64 [m, blocks, 34]
    """Byte positions in a Q8_0_R16 tensor of `total_rows` rows of each listed row's Q8_0 bytes, block by block: a
    lookup of a few rows without converting their tiles."""
    size = BLOCK_SIZES[GGMLType.Q8_0][1]
    tile, lane = ids // TILE_ROWS, ids % TILE_ROWS
    full = total_rows // TILE_ROWS
    width = torch.where(tile < full, TILE_ROWS, total_rows - full * TILE_ROWS)[:, None]
    element = torch.arange(_VALUES, device=ids.device)
    scale = 2 * lane[:, None] + torch.arange(2, device=ids.device)
    values = 2 * width + (element // 4) * 4 * width + 4 * lane[:, None] + element % 4
    within = torch.cat((scale, values), dim=1)  # [m, 34] within one block of the row's tile
    block = torch.arange(blocks, device=ids.device)[None, :, None] * size * width[:, :, None]
    return (tile * TILE_ROWS * blocks * size)[:, None, None] + block + within[:, None, :]


def take_rows(weight: QuantizedTensor, ids: Tensor) -> QuantizedTensor:  # ids int64 [m]
    """Rows `ids` of a 2-D view of the weight as an [m, K] tensor of its format, or of the source format for a
    repacked layout (an embedding lookup, or a run of rows to dequantize)."""
    shape = (int(ids.shape[0]), weight.shape[-1])
    rows = weight.data.reshape(weight.rows, weight.row_bytes)
    if weight.qtype not in SOURCE_OF:
        return QuantizedTensor(rows.index_select(0, ids), weight.qtype, shape)
    source = SOURCE_OF[weight.qtype]
    if source is GGMLType.Q8_0:  # a vocabulary table's lookups: gathered byte by byte
        blocks = weight.shape[-1] // _VALUES
        picked = rows.reshape(-1)[_q8_0_positions(ids, weight.rows, blocks)]  # [m, blocks, 34]: scale, then u
        return QuantizedTensor(
            _encode(source, picked[..., :2], picked[..., 2:]).reshape(
                shape[0], blocks * BLOCK_SIZES[source][1]
            ),
            source,
            shape,
        )
    # Other layouts: the tiles holding the rows, converted back whole (the whole tiles in one conversion, then the
    # short last one).
    tiles = torch.unique(ids // TILE_ROWS)
    full = weight.rows // TILE_ROWS
    whole = tiles[tiles < full]
    tiled = rows[: full * TILE_ROWS].reshape(full, TILE_ROWS * weight.row_bytes)[whole]
    parts = [_convert(tiled.reshape(-1, weight.row_bytes), source, to_tiles=False)]
    if len(whole) < len(tiles):
        parts.append(_convert(rows[full * TILE_ROWS :], source, to_tiles=False))
    back = torch.cat(parts)
    where = torch.searchsorted(tiles, ids // TILE_ROWS) * TILE_ROWS + ids % TILE_ROWS
    return QuantizedTensor(back.index_select(0, where), source, shape)
