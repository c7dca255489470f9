"""The quantized ops' torch specification: GGUF type table and dequantization bit-exact against gguf's reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from pagoda.pagedkernel.quant import (
    BLOCK_SIZES,
    INT4_BY_GROUP,
    GGMLType,
    QuantizedTensor,
    dequantize,
    ggml_type,
    qmatmul,
    quantize,
    repack,
)
from pagoda.pagedkernel.quant.formats import OWN_TYPES, REPACKED_TYPES
from pagoda.pagedkernel.quant.testing import assert_bit_exact, random_weight

ALL_TYPES = [
    t for t in GGMLType if t not in OWN_TYPES | REPACKED_TYPES
]  # GGUF's types (ours are tested below on their own)
# Types gguf's Python code can also quantize (the K-quants it only dequantizes).
GGUF_QUANTIZABLE = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0]


def test_type_table_matches_gguf() -> None:
    """Every type's id is gguf's, and its (elements, bytes) per block are gguf's GGML_QUANT_SIZES."""
    for qtype in ALL_TYPES:
        theirs = gguf.GGMLQuantizationType[qtype.name]
        assert int(theirs) == int(qtype)
        assert gguf.GGML_QUANT_SIZES[theirs] == BLOCK_SIZES[qtype]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape_blocks", [(1, 1), (3, 2), (7, 5)])
@pytest.mark.parametrize("scale", [0.0, 0.01])
def test_torch_dequantize_is_bit_exact(qtype: GGMLType, shape_blocks: tuple[int, int], scale: float) -> None:
    """Random blocks (scale 0: every byte random, so NaN, inf and subnormal halves too), several rows."""
    rows, blocks = shape_blocks
    shape = (rows, blocks * BLOCK_SIZES[qtype][0])
    weight = random_weight(qtype, shape, torch.Generator().manual_seed(rows * 31 + blocks), scale=scale)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = gguf_dequantize(weight.data.numpy(), gguf.GGMLQuantizationType(int(qtype)))
    assert_bit_exact(dequantize(weight, backend="torch"), torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", GGUF_QUANTIZABLE, ids=lambda t: t.name)
def test_torch_dequantize_of_gguf_quantized_weights(qtype: GGMLType) -> None:
    """Weights quantized by gguf's own writer code decode to exactly what gguf decodes them to."""
    values = np.random.default_rng(5).standard_normal((9, 128)).astype(np.float32)
    gtype = gguf.GGMLQuantizationType(int(qtype))
    raw = gguf_quantize(values, gtype)
    weight = QuantizedTensor(torch.from_numpy(raw.copy()), qtype, values.shape)
    assert_bit_exact(dequantize(weight, backend="torch"), torch.from_numpy(gguf_dequantize(raw, gtype)))


def test_any_leading_shape() -> None:
    """A 3-D tensor dequantizes to its own shape; a 1-D one to the values of the same bytes read as rows."""
    g = torch.Generator().manual_seed(2)
    three = random_weight(GGMLType.Q6_K, (2, 3, 256), g)
    assert dequantize(three, backend="torch").shape == (2, 3, 256)
    one = random_weight(GGMLType.Q8_0, (64,), g)
    as_rows = QuantizedTensor(one.data.reshape(2, 34), GGMLType.Q8_0, (2, 32))
    assert torch.equal(dequantize(one, backend="torch"), dequantize(as_rows, backend="torch").flatten())


def test_ggml_type_names_and_numbers() -> None:
    """A type by number, by name (any case) or as gguf's enum member; anything else: ValueError naming it."""
    assert ggml_type(12) is GGMLType.Q4_K
    assert ggml_type("q6_k") is GGMLType.Q6_K
    assert ggml_type(gguf.GGMLQuantizationType.Q5_0) is GGMLType.Q5_0
    cases: list[tuple[int | str, str]] = [
        (gguf.GGMLQuantizationType.Q2_K, "Q2_K"),
        ("IQ4_XS", "IQ4_XS"),
        (99, "99"),
        ("F16", "F16"),
    ]
    for bad, name in cases:
        with pytest.raises(ValueError, match=f"GGUF type {name} is not supported"):
            ggml_type(bad)


def test_quantized_tensor_checks_its_bytes() -> None:
    """Wrong dtype, a row that is not whole blocks, a byte count that does not fit, a raw int type: ValueError."""
    good = torch.zeros(2 * 18, dtype=torch.uint8)
    QuantizedTensor(good, GGMLType.Q4_0, (2, 32))
    with pytest.raises(ValueError, match="uint8"):
        QuantizedTensor(good.to(torch.int8), GGMLType.Q4_0, (2, 32))
    with pytest.raises(ValueError, match="blocks of 32"):
        QuantizedTensor(good, GGMLType.Q4_0, (3, 24))
    with pytest.raises(ValueError, match="needs 54 bytes"):
        QuantizedTensor(good, GGMLType.Q4_0, (3, 32))
    with pytest.raises(ValueError, match="GGMLType"):
        QuantizedTensor(good, 2, (2, 32))  # type: ignore[arg-type]


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_torch_qmatmul_is_float32_through_the_dequantized_weight(rows: int) -> None:
    """The torch backend is x @ dequantize(W)^T in float32, into a NaN-poisoned out=, in x's dtype."""
    g = torch.Generator().manual_seed(rows)
    weight = random_weight(GGMLType.Q4_K, (37, 512), g)
    x = torch.randn(rows, 512, generator=g)
    w = dequantize(weight, backend="torch").double()
    expected = x.double() @ w.t()
    out = torch.full((rows, 37), float("nan"))
    assert qmatmul(x, weight, backend="torch", out=out) is out
    # float32 sums of K products: each rounding at most 2^-24 of the running |sum|, bounded by sum |x| |w|.
    assert ((out.double() - expected).abs() <= 512 * 2**-24 * (x.double().abs() @ w.abs().t())).all()
    half = qmatmul(x.to(torch.bfloat16), weight, backend="torch")
    assert half.dtype == torch.bfloat16 and half.shape == (rows, 37)


def test_qmatmul_argument_checks() -> None:
    """A K that does not match, a 3-D weight, an integer x, a wrong out= or an unknown backend: ValueError."""
    g = torch.Generator().manual_seed(0)
    weight = random_weight(GGMLType.Q8_0, (5, 64), g)
    with pytest.raises(ValueError, match="does not match"):
        qmatmul(torch.randn(2, 32), weight, backend="torch")
    with pytest.raises(ValueError, match="2-D"):
        qmatmul(torch.randn(2, 64), random_weight(GGMLType.Q8_0, (2, 5, 64), g), backend="torch")
    with pytest.raises(ValueError, match="takes x of"):
        qmatmul(torch.ones(2, 64, dtype=torch.int32), weight, backend="torch")
    with pytest.raises(ValueError, match="out must be"):
        qmatmul(torch.randn(2, 64), weight, backend="torch", out=torch.empty(2, 6))
    with pytest.raises(ValueError, match="unknown quantized-op backend"):
        qmatmul(torch.randn(2, 64), weight, backend="cuda")  # type: ignore[arg-type]


def test_own_types_are_clear_of_gguf() -> None:
    """Pagoda's int4 group formats use no gguf id or name, and are 4 + group / 2 bytes per group."""
    for qtype in OWN_TYPES:
        assert qtype.name not in gguf.GGMLQuantizationType.__members__
        assert int(qtype) not in {int(t) for t in gguf.GGMLQuantizationType}
        group, size = BLOCK_SIZES[qtype]
        assert size == 4 + group // 2
    assert INT4_BY_GROUP == {32: GGMLType.Q4_1, 64: GGMLType.I4_G64, 128: GGMLType.I4_G128}


@pytest.mark.parametrize("qtype", sorted(OWN_TYPES), ids=lambda t: t.name)
def test_own_int4_groups_decode_as_specified(qtype: GGMLType) -> None:
    """Random bytes decode to d * q + m, q read from Q4_1's nibble order per 32 values (written out here)."""
    group, size = BLOCK_SIZES[qtype]
    weight = random_weight(qtype, (5, 2 * group), torch.Generator().manual_seed(int(qtype)))
    raw = weight.data.reshape(-1, size).numpy()
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    expected = np.zeros((raw.shape[0], group), dtype=np.float32)
    for b in range(raw.shape[0]):
        for i in range(group):
            byte = raw[b, 4 + 16 * (i // 32) + (i % 32) % 16]
            q = byte & 0x0F if i % 32 < 16 else byte >> 4
            expected[b, i] = d[b, 0] * np.float32(q) + m[b, 0]
    assert_bit_exact(dequantize(weight, backend="torch"), torch.from_numpy(expected.reshape(5, 2 * group)))


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_1], ids=lambda t: t.name)
def test_quantize_writes_ggufs_blocks(qtype: GGMLType) -> None:
    """Q8_0 and Q4_1 blocks are byte for byte those of gguf's reference quantizer (ties and zero blocks too)."""
    values = np.random.default_rng(3).standard_normal((7, 256)).astype(np.float32)
    values[0, :32] = 0.0  # a zero block: d = 0
    values[1, :64] = np.round(values[1, :64] * 4) / 4  # ties
    want = gguf_quantize(values, gguf.GGMLQuantizationType(int(qtype)))
    got = quantize(torch.from_numpy(values), qtype)
    assert got.shape == (7, 256)
    assert np.array_equal(got.data.numpy(), want)


@pytest.mark.parametrize("group", sorted(INT4_BY_GROUP))
def test_int4_quantization_error_is_half_a_step(group: int) -> None:
    """Each value comes back within half its group's step (plus float16 rounding of the scale and minimum)."""
    values = torch.randn(6, 512, generator=torch.Generator().manual_seed(group))
    got = dequantize(quantize(values, INT4_BY_GROUP[group]), backend="torch")
    grouped = values.reshape(-1, group)
    step = (grouped.amax(1, keepdim=True) - grouped.amin(1, keepdim=True)) / 15
    error = (got.reshape(-1, group) - grouped).abs()
    slack = 2e-3 * grouped.abs().amax(
        1, keepdim=True
    )  # float16 d and m: relative 2^-11 each, through q <= 15
    assert bool((error <= step / 2 + slack).all())
    # Larger groups share one scale over more values: the error grows, the bytes shrink.
    assert BLOCK_SIZES[INT4_BY_GROUP[group]][1] * 8 / group == 4 + 32 / group


def test_quantize_refuses_what_it_cannot_write() -> None:
    """A format quantize does not write, a ragged row, a 1-D weight: ValueError saying which."""
    with pytest.raises(ValueError, match="cannot quantize into Q6_K"):
        quantize(torch.zeros(2, 256), GGMLType.Q6_K)
    with pytest.raises(ValueError, match="I4_G128 stores rows in blocks of 128; rows of 96"):
        quantize(torch.zeros(2, 96), GGMLType.I4_G128)
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.zeros(64), GGMLType.Q8_0)


def assert_repacked_as(weight: QuantizedTensor, layout: GGMLType, expected: bytes) -> None:
    """`weight` (20 rows) repacks to `layout` with exactly the `expected` bytes, and back; rows taken from both
    tiles (a whole one and a short one) and the dequantized values are the source's; in place too."""
    packed = repack.repack(weight)
    assert packed.qtype is layout and packed.shape == weight.shape
    assert bytes(packed.data.reshape(-1).numpy()) == expected
    assert torch.equal(repack.unpack(packed).data, weight.data)
    ids = torch.tensor([19, 0, 17, 5, 16])
    assert torch.equal(repack.take_rows(packed, ids).data, repack.take_rows(weight, ids).data)
    assert torch.equal(dequantize(packed, backend="torch"), dequantize(weight, backend="torch"))
    copy = QuantizedTensor(weight.data.clone(), weight.qtype, weight.shape)
    in_place = repack.repack(copy, in_place=True)
    assert in_place.data.data_ptr() == copy.data.data_ptr() and torch.equal(in_place.data, packed.data)


@pytest.mark.parametrize("source", [GGMLType.Q8_0, GGMLType.Q4_1, GGMLType.Q5_0], ids=lambda t: t.name)
def test_repacked_layouts_as_specified(source: GGMLType) -> None:
    """The `_R16` layouts (repack.py, written out here): rows in tiles of 16 (20 rows: a tile and one of 4); per
    tile and 32-element block, the tile's float16 scales (Q4_1: then its minima), then the values u: Q8_0's bytes
    q + 128 as [8 groups of 4][rows of the tile][4]; Q4_1's nibbles and Q5_0's low four bits as [4 pairs of
    groups][rows][4] (the pair's first group low), Q5_0's fifth bits then as a bit string in [group][row][4] order.
    The conversions go both ways, in place too, and rows are taken and dequantized as the source format's; the
    ids are clear of gguf's."""
    layout = repack.LAYOUT_OF[source]
    assert layout.name not in gguf.GGMLQuantizationType.__members__
    assert int(layout) not in {int(t) for t in gguf.GGMLQuantizationType}
    n, k = 20, 64
    weight = random_weight(source, (n, k), torch.Generator().manual_seed(1))
    size = BLOCK_SIZES[source][1]
    src = weight.data.reshape(n, k // 32, size).numpy()
    halves = 4 if source is GGMLType.Q4_1 else 2

    def u(row: int, b: int, j: int) -> int:  # element j's unsigned value in the source block
        block = src[row, b]
        if source is GGMLType.Q8_0:
            return int(block[2 + j]) ^ 0x80
        byte = int(block[size - 16 + j % 16])
        nibble = byte & 15 if j < 16 else byte >> 4
        if source is GGMLType.Q4_1:
            return nibble
        qh = int.from_bytes(bytes(block[2:6]), "little")
        return nibble | ((qh >> j) & 1) << 4

    expected = bytearray()
    for t0 in range(0, n, 16):
        width = min(16, n - t0)
        for b in range(k // 32):
            for at in range(0, halves, 2):
                for r in range(width):
                    expected += bytes(src[t0 + r, b, at : at + 2])
            if source is GGMLType.Q8_0:
                for grp in range(8):
                    for r in range(width):
                        expected += bytes(u(t0 + r, b, 4 * grp + e) for e in range(4))
                continue
            for pair in range(4):
                for r in range(width):
                    expected += bytes(
                        (u(t0 + r, b, 8 * pair + e) & 15) | (u(t0 + r, b, 8 * pair + 4 + e) & 15) << 4
                        for e in range(4)
                    )
            if source is GGMLType.Q5_0:
                bits = [
                    u(t0 + r, b, 4 * grp + e) >> 4 for grp in range(8) for r in range(width) for e in range(4)
                ]
                expected += bytes(sum(bits[i + j] << j for j in range(8)) for i in range(0, len(bits), 8))
    assert_repacked_as(weight, layout, bytes(expected))


def test_q4_k_repacked_layout_as_specified() -> None:
    """`Q4_K_R16` (repack.py, written out here from ggml's Q4_K block: d, dmin, twelve bytes of 6-bit scales and
    minima as ggml's get_scale_min_k4 reads them, 32-byte groups whose low nibbles are sub-block 2 g and high ones
    2 g + 1): per tile of 16 rows (20 rows: a tile and one of 4) and super-block, the rows' d, their dmin, [8
    sub-blocks][rows] bytes of the low four bits of sc (low nibble) and m, one little-endian word per row of their
    high two bits (sc_j at 2 j, m_j at 16 + 2 j), then each sub-block's nibbles as Q4_1_R16's values. Both ways, in
    place too, rows taken and dequantized as Q4_K's; the id is clear of gguf's."""
    layout = repack.LAYOUT_OF[GGMLType.Q4_K]
    assert layout is GGMLType.Q4_K_R16 and int(layout) not in {int(t) for t in gguf.GGMLQuantizationType}
    n, k = 20, 512
    weight = random_weight(GGMLType.Q4_K, (n, k), torch.Generator().manual_seed(2))
    src = weight.data.reshape(n, k // 256, 144).numpy()

    def scale_min(row: int, s: int, j: int) -> tuple[int, int]:  # ggml's get_scale_min_k4
        q = [int(v) for v in src[row, s, 4:16]]
        if j < 4:
            return q[j] & 63, q[j + 4] & 63
        return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)

    def u(row: int, s: int, j: int, i: int) -> int:  # element i of sub-block j
        byte = int(src[row, s, 16 + 32 * (j // 2) + i])
        return byte & 15 if j % 2 == 0 else byte >> 4

    expected = bytearray()
    for t0 in range(0, n, 16):
        rows = range(t0, min(n, t0 + 16))
        for s in range(k // 256):
            for at in (0, 2):
                for r in rows:
                    expected += bytes(src[r, s, at : at + 2])
            for j in range(8):
                expected += bytes(
                    (scale_min(r, s, j)[0] & 15) | (scale_min(r, s, j)[1] & 15) << 4 for r in rows
                )
            for r in rows:
                word = sum(
                    (scale_min(r, s, j)[0] >> 4) << 2 * j | (scale_min(r, s, j)[1] >> 4) << 16 + 2 * j
                    for j in range(8)
                )
                expected += word.to_bytes(4, "little")
            for j in range(8):
                for pair in range(4):
                    for r in rows:
                        expected += bytes(
                            u(r, s, j, 8 * pair + e) | u(r, s, j, 8 * pair + 4 + e) << 4 for e in range(4)
                        )
    assert_repacked_as(weight, layout, bytes(expected))


def test_q6_k_repacked_layout_as_specified() -> None:
    """`Q6_K_R16` (repack.py, written out here from ggml's dequantize_row_q6_K: per half of 128 elements, element l
    of quarter j has ql[32 (j % 2) + l]'s low (j < 2) or high nibble and bits 2 j of qh[l], value q - 32 by scale
    (32 j + l) / 16): per tile of 16 rows (20 rows: a tile and one of 4) and super-block, the rows' d, their
    sixteen scale bytes as [scale][rows], then per 32-element block its low four bits as Q4_1_R16's values and
    [2 quads of groups][rows][4] bytes whose bits 2 i are the high two bits of group 4 quad + i. Both ways, in place
    too, rows taken and dequantized as Q6_K's; the id is clear of gguf's."""
    layout = repack.LAYOUT_OF[GGMLType.Q6_K]
    assert layout is GGMLType.Q6_K_R16 and int(layout) not in {int(t) for t in gguf.GGMLQuantizationType}
    n, k = 20, 512
    weight = random_weight(GGMLType.Q6_K, (n, k), torch.Generator().manual_seed(3))
    src = weight.data.reshape(n, k // 256, 210).numpy()

    def u(row: int, s: int, element: int) -> int:  # q + 32 of an element of super-block s
        half, rest = divmod(element, 128)
        quarter, lane = divmod(rest, 32)
        ql = int(src[row, s, 64 * half + 32 * (quarter % 2) + lane])
        qh = int(src[row, s, 128 + 32 * half + lane])
        return (ql >> 4 * (quarter // 2)) & 15 | ((qh >> 2 * quarter) & 3) << 4

    expected = bytearray()
    for t0 in range(0, n, 16):
        rows = range(t0, min(n, t0 + 16))
        for s in range(k // 256):
            for r in rows:
                expected += bytes(src[r, s, 208:210])
            for j in range(16):
                expected += bytes(int(src[r, s, 192 + j]) for r in rows)
            for b in range(8):
                for pair in range(4):
                    for r in rows:
                        expected += bytes(
                            (u(r, s, 32 * b + 8 * pair + e) & 15)
                            | (u(r, s, 32 * b + 8 * pair + 4 + e) & 15) << 4
                            for e in range(4)
                        )
                for quad in range(2):
                    for r in rows:
                        expected += bytes(
                            sum((u(r, s, 32 * b + 16 * quad + 4 * i + e) >> 4) << 2 * i for i in range(4))
                            for e in range(4)
                        )
    assert_repacked_as(weight, layout, bytes(expected))


def test_repack_refuses_other_formats() -> None:
    """Only Q8_0, Q4_1, Q5_0, Q4_K and Q6_K have a repacked layout; unpacking wants one of those layouts."""
    with pytest.raises(ValueError, match="expected a weight of Q8_0, Q4_1, Q5_0, Q4_K, Q6_K, got Q5_K"):
        repack.repack(random_weight(GGMLType.Q5_K, (16, 256), torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match=r"got Q8_0$"):
        repack.unpack(random_weight(GGMLType.Q8_0, (16, 32), torch.Generator().manual_seed(0)))
