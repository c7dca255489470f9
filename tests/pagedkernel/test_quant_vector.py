"""The vector-unit many-row matmuls of the quantized ops (csrc/cpu_quant.c: `pagoda_quant_matmul_fma`, and
`pagoda_quant_matmul_dpbf16` where the target has AVX-512 BF16).

W is dequantized a panel at a time, exactly (float32) or rounded to bfloat16 (the pair dot products), and
multiplied in float32. Every build (native, AVX-512 without BF16, AVX2 with FMA, generic C) is held to
`float32_error_bound` against the float64 product of the weights it multiplies (only summation order and fused
rounding differ between them and torch's matmul), and its typical error to `float32_typical_error` <= 1: the RMS
error within u sqrt(K) of the RMS size of each output's products (measured ~0.3; the worst case alone is ~K times
looser).
"""

from __future__ import annotations

import platform

import pytest
import torch
from pagoda.pagedkernel.cbuild import cpu_flags, for_march
from pagoda.pagedkernel.quant import GGMLType, QuantizedTensor, cpu_quant, dequantize, qmatmul
from pagoda.pagedkernel.quant.formats import REPACKED_TYPES
from pagoda.pagedkernel.quant.testing import (
    float32_error_bound,
    float32_typical_error,
    outputs_on_threads,
    random_weight,
)

ALL_TYPES = [t for t in GGMLType if t not in REPACKED_TYPES]  # a repacked layout goes to the GEMV alone
K = 768  # three runs of 256 k, and a multiple of every block
N = 77  # not a multiple of any micro tile (12, 6, 4 columns) nor of a panel (48, 24, 16 rows of W)
# -march targets and what each needs of this CPU: AVX-512 BF16 without AMX (a Zen 4's kernels: the pair dot
# products), AVX-512 without BF16 (the 32 x 12 float32 tiles), AVX2 with FMA (16 x 6), generic C (8 x 4 of plain
# multiplies and adds)
TARGETS = {"cooperlake": "avx512_bf16", "x86-64-v4": "avx512bw", "x86-64-v3": "avx2", "x86-64": "sse2"}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, cpu_quant.QuantKernels]:
    """The native library and each x86-64 target this CPU can run, built once for the module."""
    libs = {"native": cpu_quant.kernels()}
    if platform.machine() != "x86_64":
        return libs
    flags = cpu_flags()
    cache = tmp_path_factory.mktemp("kernels")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGODA_KERNEL_CACHE", str(cache))
        for march, needs in TARGETS.items():
            if needs in flags:
                target = for_march(cpu_quant.CFLAGS, march)
                libs[march] = cpu_quant.load(cpu_quant.build(target))
    return libs


def multiplied(weight: QuantizedTensor, x: torch.Tensor, lib: cpu_quant.QuantKernels) -> torch.Tensor:
    """The weights `vector` multiplies for this x: rounded to bfloat16 on the pair path, else exact."""
    exact = dequantize(weight, backend="torch")
    if x.dtype == torch.bfloat16 and lib.matmul_dpbf16 is not None:
        return exact.to(torch.bfloat16).to(torch.float32)
    return exact


def assert_within_bound(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """out (float32) is x @ w^T within float32_error_bound, every element written (no NaN left), and its typical
    error within u sqrt(K) of the products' size (`float32_typical_error`)."""
    exact = x.to(torch.float64) @ w.to(torch.float64).t()
    assert not out.isnan().any()
    assert bool(((out.to(torch.float64) - exact).abs() <= float32_error_bound(x, w)).all())
    assert float32_typical_error(out, x, w) <= 1.0


@pytest.mark.parametrize("target", ["native", *TARGETS])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_every_build_and_type_within_the_float32_bound(
    target: str, qtype: GGMLType, builds: dict[str, cpu_quant.QuantKernels]
) -> None:
    """float32 x of 17 and 70 rows (a partial block of rows on every build) into NaN-poisoned outputs."""
    if target not in builds:
        pytest.skip(f"this CPU cannot run -march={target}")
    lib = builds[target]
    g = torch.Generator().manual_seed(int(qtype))
    weight = random_weight(qtype, (N, K), g)
    for rows in (17, 70):
        x = torch.randn(rows, K, generator=g)
        out = torch.full((rows, N), float("nan"))
        cpu_quant.vector(x, weight, out, lib)
        assert_within_bound(out, x, dequantize(weight, backend="torch"))


@pytest.mark.parametrize("target", ["native", *TARGETS])
def test_bfloat16_x_and_out(target: str, builds: dict[str, cpu_quant.QuantKernels]) -> None:
    """bfloat16 x: widened exactly (float32 builds) or multiplied in pairs with W rounded to bfloat16 (AVX-512
    BF16), within the bound either way; a bfloat16 out is the float32 out rounded to nearest even, bit for bit.
    K = 800 leaves a short last run of k (800 = 3 x 256 + 32)."""
    if target not in builds:
        pytest.skip(f"this CPU cannot run -march={target}")
    lib = builds[target]
    g = torch.Generator().manual_seed(5)
    weight = random_weight(GGMLType.Q5_0, (N, 800), g)
    x = torch.randn(40, 800, generator=g).to(torch.bfloat16)
    as_float = torch.full((40, N), float("nan"))
    cpu_quant.vector(x, weight, as_float, lib)
    assert_within_bound(as_float, x, multiplied(weight, x, lib))
    rounded = torch.full((40, N), float("nan"), dtype=torch.bfloat16)
    cpu_quant.vector(x, weight, rounded, lib)
    assert torch.equal(rounded.view(torch.int16), as_float.to(torch.bfloat16).view(torch.int16))


def test_native_build_has_the_pair_kernel_where_the_cpu_does(
    builds: dict[str, cpu_quant.QuantKernels],
) -> None:
    """-march=native builds the AVX-512 BF16 matmul on a CPU with AVX-512 BF16; x86-64-v4 (no BF16) has none,
    cooperlake (BF16, no AMX) has it and no AMX matmul, and every build has the float32 one."""
    assert (builds["native"].matmul_dpbf16 is not None) == ("avx512_bf16" in cpu_flags())
    if "x86-64-v4" in builds:
        assert builds["x86-64-v4"].matmul_dpbf16 is None
    if "cooperlake" in builds:
        assert builds["cooperlake"].matmul_dpbf16 is not None and builds["cooperlake"].matmul_amx is None
    assert all(lib.matmul_fma is not None for lib in builds.values())


def test_strides_and_untouched_neighbours() -> None:
    """x a slice of a wider buffer, out a column slice of a wider one (how fused projections of mixed types
    write): only out's own elements are written, and they equal a contiguous call's."""
    lib = cpu_quant.kernels()
    g = torch.Generator().manual_seed(6)
    weight = random_weight(GGMLType.Q4_K, (N, K), g)
    x = torch.randn(33, K + 64, generator=g)[:, 32 : 32 + K]
    wide = torch.full((33, N + 10), float("nan"))
    cpu_quant.vector(x, weight, wide[:, 5 : 5 + N], lib)
    alone = torch.full((33, N), float("nan"))
    cpu_quant.vector(x.contiguous(), weight, alone, lib)
    assert torch.equal(wide[:, 5 : 5 + N], alone)
    assert wide[:, :5].isnan().all() and wide[:, 5 + N :].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_groups_of_rows_and_threads(dtype: torch.dtype) -> None:
    """More rows than one group of x (1 MB of layout: 320 rows at K = 768 in float32) and a weight of many panels:
    every output written and within the bound, the same bits on one thread as on two."""
    lib = cpu_quant.kernels()
    g = torch.Generator().manual_seed(7)
    weight = random_weight(GGMLType.Q8_0, (300, K), g)
    x = torch.randn(700, K, generator=g).to(dtype)
    one, two = outputs_on_threads(lambda out: cpu_quant.vector(x, weight, out, lib), (700, 300))
    assert torch.equal(one, two)
    assert_within_bound(one, x, multiplied(weight, x, lib))


def test_qmatmul_sends_many_rows_to_the_vector_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 x above GEMV_MAX_ROWS goes to `vector` (below VECTOR_MAX_ROWS, or for a weight too large to
    dequantize whole), fewer rows to `gemv`, VECTOR_MAX_ROWS rows of a small weight to `tiled`; float16 x is
    widened to float32 and its out rounded back."""
    calls: list[tuple[str, int]] = []
    for name in ("vector", "gemv", "tiled"):
        real = getattr(cpu_quant, name)

        def counting(x: torch.Tensor, *args: object, _real: object = real, _name: str = name) -> None:
            calls.append((_name, x.shape[0]))
            _real(x, *args)  # type: ignore[operator]

        monkeypatch.setattr(cpu_quant, name, counting)
    g = torch.Generator().manual_seed(8)
    weight = random_weight(GGMLType.Q5_0, (N, K), g)
    many = cpu_quant.VECTOR_MAX_ROWS
    x = torch.randn(many, K, generator=g)
    qmatmul(x[:40], weight, backend="cpu")
    qmatmul(x[: cpu_quant.GEMV_MAX_ROWS], weight, backend="cpu")
    qmatmul(x, weight, backend="cpu")
    half = qmatmul(x[:40].to(torch.float16), weight, backend="cpu")
    monkeypatch.setattr(cpu_quant, "WHOLE_ELEMENTS", 0)  # as for a weight too large to dequantize whole
    qmatmul(x, weight, backend="cpu")
    assert calls == [
        ("vector", 40),
        ("gemv", cpu_quant.GEMV_MAX_ROWS),
        ("tiled", many),
        ("vector", 40),
        ("vector", many),
    ]
    assert half.dtype == torch.float16
    widened = x[:40].to(torch.float16).to(torch.float32)
    torch.testing.assert_close(half, qmatmul(widened, weight, backend="torch").to(torch.float16))


def test_refusals() -> None:
    """float16 rows are a ValueError naming the dtypes; the pair kernel's C status refuses float32 x."""
    lib = cpu_quant.kernels()
    weight = random_weight(GGMLType.Q8_0, (N, K), torch.Generator().manual_seed(9))
    with pytest.raises(ValueError, match="float32 or bfloat16 rows"):
        cpu_quant.vector(torch.zeros(20, K, dtype=torch.float16), weight, torch.empty(20, N), lib)
    if lib.matmul_dpbf16 is not None:
        with pytest.raises(ValueError, match="refused its arguments"):
            cpu_quant._matmul(lib.matmul_dpbf16, torch.zeros(20, K), weight, torch.empty(20, N), "pairs")


def test_without_the_pair_kernel_bfloat16_x_is_widened(builds: dict[str, cpu_quant.QuantKernels]) -> None:
    """A library without AVX-512 BF16 multiplies bfloat16 x in float32 by the exact weights."""
    lib = builds["native"]
    plain = cpu_quant.QuantKernels(lib.path, lib.dequantize, lib.matmul, lib.matmul_fma, None, None)
    g = torch.Generator().manual_seed(10)
    weight = random_weight(GGMLType.Q6_K, (N, K), g)
    x = torch.randn(24, K, generator=g).to(torch.bfloat16)
    out = torch.full((24, N), float("nan"))
    cpu_quant.vector(x, weight, out, plain)
    assert_within_bound(out, x, dequantize(weight, backend="torch"))
