"""The AMX many-row matmul of the quantized ops (csrc/cpu_quant.c, `pagoda_quant_matmul_amx`).

W is dequantized to bfloat16 32 rows at a time and multiplied by bfloat16 x on the tile unit, products summed in
float32: the result is the float32 product of x with W rounded to bfloat16, up to float32 summation order. The
tests that run the kernel need a CPU with AMX-BF16 (a Sapphire Rapids Xeon or newer); the others hold on every CPU.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from pagoda.pagedkernel.cbuild import cpu_flags, for_march
from pagoda.pagedkernel.quant import GGMLType, QuantizedTensor, cpu_quant, dequantize, qmatmul
from pagoda.pagedkernel.quant.formats import REPACKED_TYPES
from pagoda.pagedkernel.quant.testing import outputs_on_threads, random_weight

ALL_TYPES = [t for t in GGMLType if t not in REPACKED_TYPES]  # a repacked layout goes to the GEMV alone
K = 768  # 24 tiles of 32: the k runs of 8 tiles are three, and every block format divides it
N = 77  # not a multiple of the 32-row panel nor of a 16-column tile


def amx_kernels() -> cpu_quant.QuantKernels:
    """This CPU's library, or a skip where it has no AMX matmul."""
    lib = cpu_quant.kernels()
    if lib.matmul_amx is None:
        pytest.skip("this CPU (or its OS) offers no AMX-BF16 tile unit")
    return lib


def reference(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:  # float32 [rows, N]
    """x times W rounded to bfloat16, in float32 (the products are exact; only the summation order may differ)."""
    w16 = dequantize(weight, backend="torch").to(torch.bfloat16).to(torch.float32)
    return x.to(torch.float32) @ w16.t()


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [cpu_quant.AMX_MIN_ROWS, 17, 33])
def test_amx_matches_the_rounded_weights(qtype: GGMLType, rows: int) -> None:
    """Every type, rows not a multiple of the 16-row tile: float32 out equals the reference up to float32
    rounding; NaN-poisoned outputs are all written."""
    lib = amx_kernels()
    g = torch.Generator().manual_seed(rows * 31 + int(qtype))
    weight = random_weight(qtype, (N, K), g)
    x = torch.randn(rows, K, generator=g).to(torch.bfloat16)
    out = torch.full((rows, N), float("nan"))
    cpu_quant.amx(x, weight, out, lib)
    torch.testing.assert_close(out, reference(x, weight), rtol=1e-5, atol=1e-4)


def test_amx_bfloat16_out_and_strides() -> None:
    """A bfloat16 out is the float32 result rounded to nearest even (one rounding: equal to rounding the float32
    out); x a slice of a wider buffer and out a column slice of a wider one (how fused projections of mixed types
    write) touch only their own elements."""
    lib = amx_kernels()
    g = torch.Generator().manual_seed(1)
    weight = random_weight(GGMLType.Q5_0, (N, K), g)
    x = torch.randn(20, K + 64, generator=g).to(torch.bfloat16)[:, 32 : 32 + K]
    wide = torch.full((20, N + 10), float("nan"), dtype=torch.bfloat16)
    cpu_quant.amx(x, weight, wide[:, 5 : 5 + N], lib)
    as_float = torch.full((20, N), float("nan"))
    cpu_quant.amx(x.contiguous(), weight, as_float, lib)
    assert torch.equal(wide[:, 5 : 5 + N].view(torch.int16), as_float.to(torch.bfloat16).view(torch.int16))
    assert wide[:, :5].isnan().all() and wide[:, 5 + N :].isnan().all()


def test_amx_many_rows_cross_the_row_blocks() -> None:
    """More rows than one L2 block of x (1 MB of B: 672 rows at K = 768) and a weight of many panels: every row
    and column written and right, the same bits on one thread as on two (each output is one thread's)."""
    lib = amx_kernels()
    g = torch.Generator().manual_seed(2)
    weight = random_weight(GGMLType.Q4_K, (300, K), g)
    x = torch.randn(700, K, generator=g).to(torch.bfloat16)
    one, two = outputs_on_threads(lambda out: cpu_quant.amx(x, weight, out, lib), (700, 300))
    assert torch.equal(one, two)
    torch.testing.assert_close(one, reference(x, weight), rtol=1e-5, atol=1e-4)


def test_qmatmul_takes_amx_for_many_bfloat16_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """qmatmul sends bfloat16 x of at least AMX_MIN_ROWS rows to the AMX kernel, fewer rows and float32 x to the
    others."""
    amx_kernels()
    calls: list[int] = []
    real = cpu_quant.amx

    def counting(x: torch.Tensor, *args: object) -> None:
        calls.append(x.shape[0])
        real(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_quant, "amx", counting)
    g = torch.Generator().manual_seed(3)
    weight = random_weight(GGMLType.Q8_0, (N, K), g)
    x = torch.randn(40, K, generator=g)
    qmatmul(x.to(torch.bfloat16), weight, backend="cpu")
    qmatmul(x[: cpu_quant.AMX_MIN_ROWS - 1].to(torch.bfloat16), weight, backend="cpu")
    qmatmul(x, weight, backend="cpu")
    assert calls == [40]


def test_amx_refuses_what_it_cannot_read() -> None:
    """float32 x, or a library without the AMX matmul, is a ValueError that says so."""
    lib = cpu_quant.kernels()
    weight = random_weight(GGMLType.Q8_0, (N, K), torch.Generator().manual_seed(4))
    without = cpu_quant.QuantKernels(lib.path, lib.dequantize, lib.matmul, lib.matmul_fma, None)
    with pytest.raises(ValueError, match="no AMX matmul"):
        cpu_quant.amx(torch.zeros(8, K, dtype=torch.bfloat16), weight, torch.empty(8, N), without)
    if lib.matmul_amx is not None:
        with pytest.raises(ValueError, match="bfloat16 rows"):
            cpu_quant.amx(torch.zeros(8, K), weight, torch.empty(8, N), lib)


def test_native_build_has_amx_where_the_cpu_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-march=native builds the AMX matmul on a CPU with AMX-BF16; a build for a target without it has none
    (and qmatmul then runs the vector kernel)."""
    flags = cpu_flags()
    if {"amx_bf16", "amx_tile"} <= flags:
        assert cpu_quant.kernels().matmul_amx is not None
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 target flags")
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    v3 = for_march(cpu_quant.CFLAGS, "x86-64-v3")
    assert cpu_quant.load(cpu_quant.build(v3)).matmul_amx is None
