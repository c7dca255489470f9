"""The quantized ops' torch specification: GGUF type table and dequantization bit-exact against gguf's reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from pagoda.pagedkernel.quant import BLOCK_SIZES, GGMLType, QuantizedTensor, dequantize, ggml_type, qmatmul
from pagoda.pagedkernel.quant.testing import assert_bit_exact, random_weight

ALL_TYPES = list(GGMLType)
# Types gguf's Python code can also quantize (the K-quants it only dequantizes).
GGUF_QUANTIZABLE = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0]


def test_type_table_matches_gguf() -> None:
    """Every type's id is gguf's, and its (elements, bytes) per block are gguf's GGML_QUANT_SIZES."""
    for qtype in GGMLType:
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
