"""The quantized ops' `cpu` backend (csrc/cpu_quant.c) against the torch specification and gguf's reference.

Dequantization is bit-exact. The matmul up to GEMV_MAX_ROWS rows quantizes x to int8 per 32 elements, so it is held
to `int8_error_bound` (the rounding of x, |dx| / 2 per element, through |W|, plus float32 rounding); above that
it multiplies the exact dequantized weights in float32, within float32 rounding of the exact product. The VNNI, AVX2 and
generic builds each run and agree bitwise.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from pagoda.pagedkernel.backend import BackendUnavailableError
from pagoda.pagedkernel.cbuild import cpu_flags, for_march
from pagoda.pagedkernel.quant import (
    GGMLType,
    QuantizedTensor,
    cpu_quant,
    dequantize,
    dequantize_ids,
    qmatmul,
    repack,
)
from pagoda.pagedkernel.quant.cpu_quant import GEMV_MAX_ROWS, KernelPath
from pagoda.pagedkernel.quant.formats import OWN_TYPES, REPACKED_TYPES
from pagoda.pagedkernel.quant.testing import (
    assert_bit_exact,
    float32_error_bound,
    float32_typical_error,
    int8_error_bound,
    random_weight,
)
from pagoda.pagedkernel.quant.torch_quant import k_scales

ALL_TYPES = list(GGMLType)
GGUF_TYPES = [
    t for t in GGMLType if t not in OWN_TYPES | REPACKED_TYPES
]  # the ones gguf's reference decodes too
K = 768  # a multiple of every block (32 and 256)
N = 77  # a multiple of nothing


def nan_out(rows: int, n: int) -> torch.Tensor:
    """An output buffer full of NaN, so that any element the kernel misses fails the comparison."""
    return torch.full((rows, n), float("nan"))


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("scale", [0.0, 0.01])
def test_dequantize_is_bit_exact(qtype: GGMLType, scale: float) -> None:
    """Random blocks (scale 0: NaN, inf and subnormal halves too), 9 rows of 3 super-blocks (parallel blocks)."""
    weight = random_weight(qtype, (9, K), torch.Generator().manual_seed(int(qtype)), scale=scale)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = gguf_dequantize(weight.data.numpy(), gguf.GGMLQuantizationType(int(qtype)))
    assert_bit_exact(dequantize(weight, backend="cpu"), torch.from_numpy(expected))
    assert torch.equal(
        dequantize(weight, backend="cpu").nan_to_num(7.0), dequantize(weight, backend="torch").nan_to_num(7.0)
    )


@pytest.mark.parametrize("qtype", sorted(OWN_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("scale", [0.0, 0.01])
def test_own_formats_dequantize_bit_exact_with_the_specification(qtype: GGMLType, scale: float) -> None:
    """Pagoda's int4 group formats have no gguf reference: the C decoder equals the torch specification bitwise."""
    weight = random_weight(qtype, (9, K), torch.Generator().manual_seed(int(qtype)), scale=scale)
    assert_bit_exact(dequantize(weight, backend="cpu"), dequantize(weight, backend="torch"))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS])
def test_int8_matmul_within_its_bound(qtype: GGMLType, rows: int) -> None:
    """Few rows: every output within int8_error_bound of the float64 product with the exact weights."""
    g = torch.Generator().manual_seed(rows * 100 + int(qtype))
    weight = random_weight(qtype, (N, K), g)
    x = torch.randn(rows, K, generator=g) * torch.rand(rows, K, generator=g) * 3  # uneven block maxima
    w = dequantize(weight, backend="torch")
    out = nan_out(rows, N)
    assert qmatmul(x, weight, backend="cpu", out=out) is out
    err = (out.double() - x.double() @ w.double().t()).abs()
    assert (err <= int8_error_bound(x, w)).all()
    # And it is a real approximation, not just inside a loose bound: ~0.5% of the output's norm here.
    assert err.norm() <= 0.02 * (x.double() @ w.double().t()).norm()


@pytest.mark.parametrize(
    "qtype", [GGMLType.Q4_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name
)
@pytest.mark.parametrize("rows", [GEMV_MAX_ROWS + 1, 40])
def test_many_rows_match_the_float32_reference(qtype: GGMLType, rows: int) -> None:
    """Many rows: the exact dequantized weights multiplied in float32 (the vector kernel), within float32 rounding
    of the float64 product: every output within the worst case (`float32_error_bound`, ~K u of sum |x| |w|), and
    the typical error within its expected size u sqrt(K) (`float32_typical_error` <= 1; measured ~0.3, torch's
    own float32 matmul ~0.2), which pins what the worst case, ~K times looser, would let drift."""
    g = torch.Generator().manual_seed(rows + int(qtype))
    weight = random_weight(qtype, (N, K), g)
    x = torch.randn(rows, K, generator=g)
    out = nan_out(rows, N)
    qmatmul(x, weight, backend="cpu", out=out)
    w = dequantize(weight, backend="torch")
    error = (out.double() - x.double() @ w.double().t()).abs()
    assert bool((error <= float32_error_bound(x, w)).all())
    assert float32_typical_error(out, x, w) <= 1.0


def test_tiles_cover_every_column(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles smaller than N (here 5 rows of W, the last one short) still write every output column."""
    monkeypatch.setattr(cpu_quant, "TILE_ELEMENTS", 5 * K)
    monkeypatch.setattr(cpu_quant, "WHOLE_ELEMENTS", 0)
    g = torch.Generator().manual_seed(3)
    weight = random_weight(GGMLType.Q5_0, (N, K), g)
    x = torch.randn(20, K, generator=g)
    out = nan_out(20, N)
    cpu_quant.tiled(x, weight, out, cpu_quant.kernels())
    torch.testing.assert_close(out, qmatmul(x, weight, backend="torch"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "qtype",
    [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_1, GGMLType.Q5_1],
)
def test_gemv_row_groups(qtype: GGMLType) -> None:
    """The C kernel called with more rows than one group (16) computes each row as it would alone (one row of
    Q4_0 / Q5_1 takes the one-row register path, several rows the few-row register path in passes of 8, 37 = 4 x 8
    + 5: the same bits as matmul_columns; Q5_0 / Q8_0 / Q4_1 / Q4_K the quad order at any row count)."""
    g = torch.Generator().manual_seed(4)
    weight = random_weight(qtype, (N, K), g)
    x = torch.randn(37, K, generator=g)
    lib = cpu_quant.kernels()
    together = nan_out(37, N)
    cpu_quant.gemv(x, weight, together, lib)
    for r in (0, 16, 36):
        alone = nan_out(1, N)
        cpu_quant.gemv(x[r : r + 1], weight, alone, lib)
        assert torch.equal(together[r : r + 1], alone)


def test_dtypes_strides_and_empty() -> None:
    """bfloat16 x returns bfloat16; a strided x (a slice of a wider buffer) reads only its columns; zero rows."""
    g = torch.Generator().manual_seed(5)
    weight = random_weight(GGMLType.Q8_0, (N, K), g)
    wide = torch.randn(4, K + 64, generator=g)
    x = wide[:, :K]
    assert torch.equal(qmatmul(x, weight, backend="cpu"), qmatmul(x.contiguous(), weight, backend="cpu"))
    half = qmatmul(
        x.to(torch.bfloat16), weight, backend="cpu", out=torch.full((4, N), float("nan")).bfloat16()
    )
    assert half.dtype == torch.bfloat16 and not half.isnan().any()
    assert qmatmul(x[:0], weight, backend="cpu").shape == (0, N)


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.I4_G128], ids=lambda t: t.name)
def test_bfloat16_rows_go_straight_through_the_kernel(qtype: GGMLType) -> None:
    """bfloat16 x and a bfloat16 out read and written by the kernel itself equal the float32 path on the widened x,
    rounded to nearest even (bitwise); a strided bfloat16 x and a float32 out of a bfloat16 x agree too."""
    g = torch.Generator().manual_seed(int(qtype))
    weight = random_weight(qtype, (N, K), g)
    lib = cpu_quant.kernels()
    wide = torch.randn(3, K + 32, generator=g).to(torch.bfloat16)
    x = wide[:, :K]  # rows K + 32 apart
    reference = nan_out(3, N)
    cpu_quant.gemv(x.to(torch.float32).contiguous(), weight, reference, lib)
    direct = torch.full((3, N), float("nan"), dtype=torch.bfloat16)
    cpu_quant.gemv(x, weight, direct, lib)
    assert torch.equal(direct.view(torch.int16), reference.to(torch.bfloat16).view(torch.int16))
    widened = nan_out(3, N)
    cpu_quant.gemv(x, weight, widened, lib)
    assert torch.equal(widened, reference)
    assert torch.equal(qmatmul(x, weight, backend="cpu").view(torch.int16), direct.view(torch.int16))
    with pytest.raises(ValueError, match="float32 or bfloat16 rows"):
        cpu_quant.gemv(x.to(torch.float16), weight, direct, lib)


def test_thread_count_does_not_change_the_result() -> None:
    """Each output is computed whole by one thread: 1 and 2 threads give the same bits."""
    g = torch.Generator().manual_seed(6)
    weight = random_weight(GGMLType.Q6_K, (1024, K), g)  # large enough to run in parallel
    x = torch.randn(3, K, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qmatmul(x, weight, backend="cpu")
        torch.set_num_threads(2)
        two = qmatmul(x, weight, backend="cpu")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_native_build_takes_the_best_path() -> None:
    """-march=native compiles the VNNI path on a CPU with AVX-512 VNNI, AVX2's on one with AVX2 only."""
    flags = cpu_flags()
    path = cpu_quant.kernels().path
    if {"avx512_vnni", "avx512vl", "avx2"} <= flags:
        assert path is KernelPath.AVX512_VNNI
    elif "avx2" in flags:
        assert path is KernelPath.AVX2
    else:
        assert path is KernelPath.GENERIC


@pytest.mark.parametrize(
    ("march", "path"),
    [
        ("x86-64-v3", KernelPath.AVX2),
        ("x86-64", KernelPath.GENERIC),
        # AVX-512 VNNI without VBMI (Cascade Lake): the quad order's 256-bit form with vpdpbusd
        ("cascadelake", KernelPath.AVX512_VNNI),
    ],
)
def test_every_path_gives_the_same_bits(
    march: str, path: KernelPath, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The AVX2 build and the generic C build compute bitwise what the native (VNNI here) build computes."""
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 target flags")
    if path is KernelPath.AVX2 and "avx2" not in cpu_flags():
        pytest.skip("this CPU has no AVX2")
    if path is KernelPath.AVX512_VNNI and not {"avx512_vnni", "avx512vl", "avx512bw"} <= cpu_flags():
        pytest.skip("this CPU has no AVX-512 VNNI")
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    flags = for_march(cpu_quant.CFLAGS, march)
    other = cpu_quant.load(cpu_quant.build(flags))
    assert other.path is path
    native = cpu_quant.kernels()
    g = torch.Generator().manual_seed(7)
    for qtype in ALL_TYPES:
        weight = random_weight(qtype, (N, K), g)
        x = torch.randn(5, K, generator=g)
        mine, theirs = nan_out(5, N), nan_out(5, N)
        cpu_quant.gemv(x, weight, mine, other)
        cpu_quant.gemv(x, weight, theirs, native)
        assert torch.equal(mine, theirs), qtype.name
        one_mine, one_theirs = (
            nan_out(1, N),
            nan_out(1, N),
        )  # one row: the register-only path where it applies
        cpu_quant.gemv(x[:1], weight, one_mine, other)
        cpu_quant.gemv(x[:1], weight, one_theirs, native)
        assert torch.equal(one_mine, one_theirs) and torch.equal(one_mine, theirs[:1]), qtype.name
        assert torch.equal(cpu_quant.dequantize(weight, other), cpu_quant.dequantize(weight, native))


@pytest.fixture(scope="module")
def every_build(tmp_path_factory: pytest.TempPathFactory) -> list[cpu_quant.QuantKernels]:
    """The native library, then the generic x86-64 build and (where the CPU runs it) the AVX2 one, compiled once for
    this module's tests into a fresh cache (each test had compiled both again: ~17 s a test); skips off x86-64."""
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 target flags")
    marches = ["x86-64"] + (["x86-64-v3"] if "avx2" in cpu_flags() else [])
    native = cpu_quant.kernels()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path_factory.mktemp("every_build")))
        others = [cpu_quant.load(cpu_quant.build(for_march(cpu_quant.CFLAGS, m))) for m in marches]
    return [native, *others]


QUAD_CASES = [
    *((qtype, k) for qtype in (GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q8_0) for k in (544, 576, 608)),
    (GGMLType.Q4_K, K),
    (GGMLType.Q6_K, K),
]


@pytest.mark.parametrize(("qtype", "k"), QUAD_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_quad_order_on_every_path_and_row_count(
    qtype: GGMLType, k: int, every_build: list[cpu_quant.QuantKernels]
) -> None:
    """Q4_1, Q5_0, Q8_0, Q4_K and Q6_K go four 32-element blocks at a time (cpu_quad.h): with 17, 18 or 19 blocks
    per row the last group is short (1, 2, 3 blocks); Q4_K's groups are half super-blocks, Q6_K keeps a block's
    halves in two sums and from 8 rows takes two columns a pass of 4 rows. Every build (native, AVX2, generic C)
    and every row count (1, 2 and 3 rows: two columns at a time on AVX-512, one row so on AVX2; 5; 11: a pass of 8
    and one of 3; 19: a block of 16 rows, then one of 3) give the same bits, each within the int8 bound of the exact
    product."""
    builds = every_build
    g = torch.Generator().manual_seed(k + int(qtype))
    weight = random_weight(qtype, (N, k), g)
    x = torch.randn(19, k, generator=g) * torch.rand(19, k, generator=g) * 3
    w = dequantize(weight, backend="torch")
    exact = x.double() @ w.double().t()
    first: torch.Tensor | None = None
    for lib in builds:
        many = nan_out(19, N)
        cpu_quant.gemv(x, weight, many, lib)
        assert ((many.double() - exact).abs() <= int8_error_bound(x, w)).all()
        for r, rows in ((0, 1), (5, 1), (10, 1), (18, 1), (1, 2), (6, 3), (0, 5), (3, 11)):
            part = nan_out(rows, N)
            cpu_quant.gemv(x[r : r + rows], weight, part, lib)
            assert torch.equal(part, many[r : r + rows])
        if first is None:
            first = many
        assert torch.equal(many, first)


def test_non_finite_x_quantizes_alike_on_every_path(every_build: list[cpu_quant.QuantKernels]) -> None:
    """x's int8 quantization is vectorized on the AVX2 and VNNI paths: a NaN (skipped by the block's maximum, then
    -127), an infinity (the block's scale infinite, its finite values 0) and a zero block give the same bits as the
    generic C path's scalar loop, for a per-block format and the quad order (a signed and an unsigned format)."""
    builds = every_build
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, K, generator=g)
    x[0, 5] = float("nan")  # early in its block, and late in the next (the last of a block's vectors)
    x[0, 32 + 29] = float("nan")
    x[1, 40] = float("inf")
    x[2, 64:96] = 0.0
    for qtype in (GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_1):
        weight = random_weight(qtype, (N, K), g)
        outs = []
        for lib in builds:
            out = nan_out(3, N)
            cpu_quant.gemv(x, weight, out, lib)
            outs.append(out.view(torch.int32))
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), qtype.name


def test_the_build_without_openmp_agrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler without OpenMP gets a single-threaded library with the same bits."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_quant, "OPENMP_FLAGS", ())
    single = cpu_quant.load(cpu_quant.build())
    g = torch.Generator().manual_seed(8)
    weight = random_weight(GGMLType.Q4_K, (1024, K), g)
    x = torch.randn(2, K, generator=g)
    mine, theirs = nan_out(2, 1024), nan_out(2, 1024)
    cpu_quant.gemv(x, weight, mine, single)
    cpu_quant.gemv(x, weight, theirs, cpu_quant.kernels())
    assert torch.equal(mine, theirs)


def test_the_kernel_refuses_an_unknown_type() -> None:
    """Type ids it does not know (Q2_K = 10) and a K that is not whole blocks get a status, not a crash."""
    lib = cpu_quant.kernels()
    src, dst = torch.zeros(84, dtype=torch.uint8), torch.empty(256)
    assert lib.dequantize(10, src.data_ptr(), dst.data_ptr(), 0, 1, 1) == 1
    y = torch.empty(1, 1)
    assert lib.matmul(10, src.data_ptr(), 1, 256, dst.data_ptr(), 256, 0, 1, y.data_ptr(), 1, 0, 1) == 1
    assert (
        lib.matmul(int(GGMLType.Q4_K), src.data_ptr(), 1, 32, dst.data_ptr(), 32, 0, 1, y.data_ptr(), 1, 0, 1)
        == 1
    )
    with pytest.raises(ValueError, match="refused its arguments"):
        cpu_quant._check(1, "quantized matmul")  # what gemv and dequantize raise on that status
    with pytest.raises(MemoryError):
        cpu_quant._check(2, "quantized matmul")


def test_without_a_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No compiler: building says so; backend='cpu' raises BackendUnavailableError, 'auto' warns and uses torch."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(BackendUnavailableError, match="found no C compiler"):
        cpu_quant.build()

    def unavailable() -> cpu_quant.QuantKernels:
        return cpu_quant.load(cpu_quant.build())

    monkeypatch.setattr(cpu_quant, "kernels", unavailable)
    weight = random_weight(GGMLType.Q8_0, (3, 64), torch.Generator().manual_seed(9))
    with pytest.raises(BackendUnavailableError):
        dequantize(weight, backend="cpu")
    cpu_quant.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert torch.equal(dequantize(weight), dequantize(weight, backend="torch"))
            x = torch.randn(2, 64)
            assert torch.equal(qmatmul(x, weight), qmatmul(x, weight, backend="torch"))
    finally:
        cpu_quant.available.cache_clear()  # the next test sees this machine's compiler again
    assert caplog.text.count("fall back to torch") == 1  # checked once, not at every call


def test_cpu_backend_wants_cpu_tensors() -> None:
    """backend='cpu' on a weight elsewhere (the meta device here), or x and W on two devices: ValueError."""
    weight = QuantizedTensor(torch.empty(18, dtype=torch.uint8, device="meta"), GGMLType.Q4_0, (1, 32))
    with pytest.raises(ValueError, match="meta"):
        dequantize(weight, backend="cpu")
    with pytest.raises(ValueError, match="x is on cpu, the weight on meta"):
        qmatmul(torch.randn(1, 32), weight)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_bfloat16_tiles_are_the_rounded_values(qtype: GGMLType) -> None:
    """Dequantizing into bfloat16 rounds each exact float32 value to nearest even, as torch's conversion does."""
    weight = random_weight(qtype, (9, K), torch.Generator().manual_seed(10 + int(qtype)), scale=0.0)
    out = torch.empty((9, K), dtype=torch.bfloat16)
    cpu_quant.dequantize_rows(weight, 0, 9, out, cpu_quant.kernels())
    expected = dequantize(weight, backend="torch").to(torch.bfloat16)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_quant.dequantize_rows(weight, 0, 9, torch.empty((9, K), dtype=torch.float16), cpu_quant.kernels())


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda t: t.name)
def test_many_bfloat16_rows_are_the_dense_bfloat16_matmul(qtype: GGMLType) -> None:
    """bfloat16 x above GEMV_MAX_ROWS: the rounded weights in bfloat16 (AMX, or AVX-512 BF16 pairs; a CPU with
    neither multiplies the exact ones in float32), so the result is torch's bfloat16 matmul of the dense bfloat16
    weight (the dequantize-at-load numerics) up to bfloat16 tolerances."""
    g = torch.Generator().manual_seed(11)
    weight = random_weight(qtype, (N, K), g)
    x = torch.randn(40, K, generator=g).to(torch.bfloat16)
    out = torch.full((40, N), float("nan"), dtype=torch.bfloat16)
    assert qmatmul(x, weight, backend="cpu", out=out) is out
    lib = cpu_quant.kernels()
    exact = dequantize(weight, backend="torch")
    rounded = lib.matmul_amx is not None or lib.matmul_dpbf16 is not None
    w = exact.to(torch.bfloat16).to(torch.float32) if rounded else exact
    # bfloat16 tolerances: only the summation order and the output's one rounding may differ
    torch.testing.assert_close(out, (x.to(torch.float32) @ w.t()).to(torch.bfloat16))
    if rounded:
        dense = x @ exact.to(torch.bfloat16).t()
        torch.testing.assert_close(out, dense)  # and so it is the dense bfloat16 matmul


def source_fields(weight: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A repacked weight's blocks read back in its source format and decoded here: float32 d [N, blocks, halves] per
    32-element block or each half of it (Q6_K's 16-element sub-blocks) and m [N, blocks] (zero without a minimum;
    Q4_K's d * sc and -(dmin * m), Q6_K's d * sc: exact float32 products), the unsigned values u [N, blocks, 32]
    and what u adds to the value (z)."""
    source = repack.unpack(weight)
    if source.qtype is GGMLType.Q6_K:
        # ggml's order: per half of 128, quarter j from ql's nibbles and qh's bits 2 j
        sup = source.blocks().reshape(weight.shape[0], weight.shape[1] // 256, 210).to(torch.int64)
        ql, qh = (
            sup[..., :128].reshape(*sup.shape[:2], 2, 2, 32),
            sup[..., 128:192].reshape(*sup.shape[:2], 2, 32),
        )
        u = torch.stack(
            [(ql[..., j % 2, :] >> 4 * (j // 2)) & 15 | ((qh >> 2 * j) & 3) << 4 for j in range(4)], dim=-2
        ).reshape(weight.shape[0], -1, 32)
        sc = source.blocks().reshape(*sup.shape[:2], 210)[..., 192:208].contiguous().view(torch.int8)
        d16 = source.blocks().reshape(*sup.shape[:2], 210)[..., 208:].contiguous().view(torch.float16)
        d = (d16.to(torch.float32) * sc.to(torch.float32)).reshape(weight.shape[0], -1, 2)
        return d, torch.zeros(d.shape[:2]), u, 32
    if source.qtype is GGMLType.Q4_K:
        sup = source.blocks().reshape(weight.shape[0], weight.shape[1] // 256, 144)
        ds = sup[..., 0:4].contiguous().view(torch.float16).to(torch.float32)  # [N, super-blocks, 2]: d, dmin
        sc, mins = k_scales(sup[..., 4:16].reshape(-1, 12))
        sc, mins = sc.reshape(*sup.shape[:2], 8), mins.reshape(*sup.shape[:2], 8)
        nibbles = sup[..., 16:].reshape(*sup.shape[:2], 4, 32).to(torch.int64)
        u = torch.stack((nibbles & 15, nibbles >> 4), dim=-2).reshape(weight.shape[0], -1, 32)
        d = (ds[..., :1] * sc.to(torch.float32)).reshape(weight.shape[0], -1, 1)
        m = -(ds[..., 1:] * mins.to(torch.float32)).reshape(weight.shape[0], -1)
        return d, m, u, 0
    raw = source.blocks().reshape(weight.shape[0], weight.shape[1] // 32, -1)

    def half(at: int) -> torch.Tensor:
        return raw[..., at : at + 2].contiguous().view(torch.float16).to(torch.float32)[..., 0]

    d, m = half(0)[..., None], torch.zeros(raw.shape[:2])
    if source.qtype is GGMLType.Q8_0:
        return d, m, (raw[..., 2:].to(torch.int64) + 128) % 256, 128
    nibbles = raw[..., -16:].to(torch.int64)
    u = torch.cat((nibbles & 15, nibbles >> 4), dim=-1)
    if source.qtype is GGMLType.Q4_1:
        return d, half(2), u, 0
    qh = raw[..., 2:6].to(torch.int64)
    fifth = torch.stack([(qh[..., j // 8] >> (j % 8)) & 1 for j in range(32)], dim=-1)
    return d, m, u | fifth << 4, 16


def r16_reference(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:  # float32 [rows, K] -> [rows, N]
    """cpu_rows16.h's arithmetic written out: x quantized per 32 elements as quantize_row does (dx = max|x| / 127,
    q = round(x / dx) to nearest even), L the exact integer sum of each block's (or half block's, Q6_K) (u - z) q,
    then per block (and half) in order acc = fma(L, d * dx, acc), and with a minimum acc = fma(m, dx * sum q, acc):
    each fused multiply-add's one
    rounding taken from its exact float64 value (a product of at most 19 and 24 significant bits is exact there,
    so only the add rounds before the final float32 rounding)."""
    rows, k = x.shape
    blocks = k // 32
    xb = x.reshape(rows, blocks, 32)
    dx = xb.abs().amax(-1) / 127.0  # float32, as the C division
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127).to(torch.int64)  # round half to even, as nearbyintf
    d, m, u, z = source_fields(weight)
    halves = d.shape[-1]
    split = q.reshape(rows, blocks, halves, 32 // halves)
    lanes = torch.einsum(
        "rbhi,nbhi->rnbh", split, (u - z).reshape(*u.shape[:2], halves, 32 // halves)
    )  # exact
    sums = q.sum(-1).to(torch.float32)  # [rows, blocks]
    acc = torch.zeros(rows, weight.shape[0], dtype=torch.float32)

    def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (a.to(torch.float64) * b.to(torch.float64) + c.to(torch.float64)).to(torch.float32)

    for b in range(blocks):
        for h in range(halves):
            acc = fma(lanes[..., b, h].to(torch.float32), d[None, :, b, h] * dx[:, None, b], acc)
        if bool(m.any()):
            acc = fma(m[None, :, b].expand_as(acc), (dx[:, b] * sums[:, b])[:, None].expand_as(acc), acc)
    return acc


@pytest.mark.parametrize("qtype", sorted(REPACKED_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("k", [544, 768])
def test_repacked_layouts_on_every_path_and_row_count(
    qtype: GGMLType, k: int, every_build: list[cpu_quant.QuantKernels]
) -> None:
    """Q8_0_R16, Q4_1_R16, Q5_0_R16, Q4_K_R16 and Q6_K_R16 (sixteen rows to a tile; N = 77: four tiles and one of
    13; K 544 or 768, the K formats' 512 or 768: whole super-blocks) on every build
    (VNNI, AVX2, generic C) and at every row count (1-3, 8: one pass; 9, 11: a pass of 8 and a short one; 19: more
    than GEMV_MAX_ROWS in one call) give the bits of their written-out arithmetic, the same for a row whatever
    rows share its call, within the int8 bound of the exact product; dequantized bit-exact."""
    k = k // 256 * 256 if qtype in (GGMLType.Q4_K_R16, GGMLType.Q6_K_R16) else k
    builds = every_build
    g = torch.Generator().manual_seed(k + int(qtype))
    weight = random_weight(qtype, (N, k), g)
    x = torch.randn(19, k, generator=g) * torch.rand(19, k, generator=g) * 3
    want = r16_reference(x, weight)
    w = dequantize(weight, backend="torch")
    assert ((want.double() - x.double() @ w.double().t()).abs() <= int8_error_bound(x, w)).all()
    for lib in builds:
        for r, rows in ((0, 19), (0, 1), (18, 1), (1, 2), (6, 3), (2, 8), (3, 9), (5, 11)):
            got = nan_out(rows, N)
            cpu_quant.gemv(x[r : r + rows], weight, got, lib)
            assert torch.equal(got, want[r : r + rows]), (lib.path, rows)
        half = torch.full((19, N), float("nan"), dtype=torch.bfloat16)
        cpu_quant.gemv(
            x.bfloat16(), weight, half, lib
        )  # bfloat16 in and out: read exactly, rounded at the end
        assert torch.equal(half, r16_reference(x.bfloat16().float(), weight).bfloat16())
        # dequantized by whole tiles in C (rows 16.. end: three tiles and the short one), and by any rows
        assert_bit_exact(cpu_quant.dequantize(weight, lib), w)
        tail = torch.full((N - 16, k), float("nan"), dtype=torch.bfloat16)
        cpu_quant.dequantize_rows(weight, 16, N, tail, lib)
        assert torch.equal(tail, w[16:].bfloat16())
        odd = torch.full((5, k), float("nan"))
        cpu_quant.dequantize_rows(weight, 3, 8, odd, lib)  # off the tiles: the rows gathered first
        assert torch.equal(odd, w[3:8])
        # rows by id straight from their tiles: the short tile's last row, tile edges, a repeat
        ids = torch.tensor([76, 0, 15, 16, 64, 76, 33])
        assert torch.equal(cpu_quant.dequantize_ids(weight, ids, lib), w[ids])


@pytest.mark.parametrize(
    "qtype", [GGMLType.Q6_K_R16, GGMLType.Q5_0_R16, GGMLType.Q8_0_R16], ids=lambda t: t.name
)
def test_repacked_layouts_across_blocks_of_rows(
    qtype: GGMLType, every_build: list[cpu_quant.QuantKernels]
) -> None:
    """Many rows go through the tiles in blocks of rows whose int8 x stays in L2 (cpu_rows16.h's block_rows: 32
    rows at K = 8,192), Q6_K's half sums of q computed once per block: 32 + 3 rows (a short last block on the
    many-row pass), 32 + 2 (on the two-row pass) and 32 + 5 give every row the bits of the written-out arithmetic
    on every build."""
    k = 8192
    builds = every_build
    g = torch.Generator().manual_seed(int(qtype))
    weight = random_weight(qtype, (35, k), g)  # two whole tiles and a short one
    x = torch.randn(37, k, generator=g) * torch.rand(37, k, generator=g) * 3
    want = r16_reference(x, weight)
    for lib in builds:
        for rows in (35, 34, 37):
            got = nan_out(rows, 35)
            cpu_quant.gemv(x[:rows], weight, got, lib)
            assert torch.equal(got, want[:rows]), (lib.path, rows)


@pytest.mark.parametrize("path", list(KernelPath), ids=lambda p: p.name)
def test_repacked_layout_policy_per_build(path: KernelPath, monkeypatch: pytest.MonkeyPatch) -> None:
    """`repacked_layout`: the `_R16` tiles on the VNNI and AVX2 builds (their int8 tiles), none on the generic one
    (its plain loop is only the specification); a weight that multiplies prompts keeps its format on a build with
    AMX (its bfloat16 tiles take prompts), and Q6_K on AVX2 (the float32 vector kernel runs its prompts faster);
    Q4_0 has no repacked layout anywhere. `int8_at_any_rows`: the tiles take a prompt's many rows on AVX2 (but
    Q6_K_R16's), the tiled path elsewhere."""
    native = cpu_quant.kernels()
    monkeypatch.setattr(cpu_quant, "kernels", lambda: dataclasses.replace(native, path=path, matmul_amx=None))
    tiled = path is not KernelPath.GENERIC
    for source, layout in repack.LAYOUT_OF.items():
        assert cpu_quant.repacked_layout(source) is (layout if tiled else None), source.name
        keeps = path is KernelPath.AVX2 and source is GGMLType.Q6_K
        assert cpu_quant.repacked_layout(source, prompts=True) is (layout if tiled and not keeps else None)
    assert cpu_quant.repacked_layout(GGMLType.Q4_0) is None
    # a prompt's many rows of a repacked weight: the int8 tiles on AVX2 (not Q6_K's), the tiled path elsewhere
    lib = cpu_quant.kernels()
    for layout in REPACKED_TYPES:
        int8 = path is KernelPath.AVX2 and layout is not GGMLType.Q6_K_R16
        assert cpu_quant.int8_at_any_rows(layout, lib) is int8, layout.name
    assert not cpu_quant.int8_at_any_rows(GGMLType.Q5_0, lib)
    amx = dataclasses.replace(native, path=KernelPath.AVX512_VNNI, matmul_amx=object())
    monkeypatch.setattr(cpu_quant, "kernels", lambda: amx)
    assert cpu_quant.repacked_layout(GGMLType.Q8_0, prompts=True) is None
    assert cpu_quant.repacked_layout(GGMLType.Q8_0) is GGMLType.Q8_0_R16


@pytest.mark.parametrize("qtype", sorted(REPACKED_TYPES), ids=lambda t: t.name)
def test_repacked_layouts_take_the_int8_kernel_below_the_tiled_rows(qtype: GGMLType) -> None:
    """qmatmul multiplies a repacked weight by its int8 kernel up to VECTOR_MAX_ROWS rows (past GEMV_MAX_ROWS and
    the AMX threshold), bfloat16 rows included; from there a weight small enough is dequantized whole (the C
    dequantization of whole tiles) for torch's matmul, as a row-major one is, except where `int8_at_any_rows` says
    the int8 kernel runs prompts faster (AVX2); the vector and AMX paths refuse it by name."""
    g = torch.Generator().manual_seed(3)
    k = 256 if qtype in (GGMLType.Q4_K_R16, GGMLType.Q6_K_R16) else 64  # whole blocks of the source format
    weight = random_weight(qtype, (40, k), g)
    x = torch.randn(cpu_quant.VECTOR_MAX_ROWS, k, generator=g)
    few = x[:300]
    assert torch.equal(qmatmul(few, weight, backend="cpu"), r16_reference(few, weight))
    assert torch.equal(
        qmatmul(few.bfloat16(), weight, backend="cpu"),
        r16_reference(few.bfloat16().float(), weight).bfloat16(),
    )
    w = dequantize(weight, backend="torch")
    lib = cpu_quant.kernels()
    if cpu_quant.int8_at_any_rows(qtype, lib):
        assert torch.equal(qmatmul(x, weight, backend="cpu"), r16_reference(x, weight))
        assert torch.equal(
            qmatmul(x.bfloat16(), weight, backend="cpu"),
            r16_reference(x.bfloat16().float(), weight).bfloat16(),
        )
    else:
        assert torch.equal(qmatmul(x, weight, backend="cpu"), x @ w.t())
        assert torch.equal(qmatmul(x.bfloat16(), weight, backend="cpu"), x.bfloat16() @ w.bfloat16().t())
    with pytest.raises(ValueError, match=f"vector does not take the repacked {qtype.name}"):
        cpu_quant.vector(x[:20], weight, torch.empty(20, 40), lib)
    with pytest.raises(ValueError, match=f"amx does not take the repacked {qtype.name}"):
        cpu_quant.amx(x[:20].bfloat16(), weight, torch.empty(20, 40), lib)


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q8_0_R16, GGMLType.Q4_1_R16], ids=lambda t: t.name)
def test_dequantize_ids_is_an_embedding_lookup(qtype: GGMLType) -> None:
    """`dequantize_ids` gives `dequantize(weight)[ids]` on both backends, repacked or not, none and one id too; an
    id out of range is a ValueError naming the range (the C call checks every id before writing)."""
    weight = random_weight(qtype, (21, 64), torch.Generator().manual_seed(5))
    w = dequantize(weight, backend="torch")
    for ids in (torch.tensor([20, 3, 3, 16]), torch.tensor([7]), torch.zeros(0, dtype=torch.int64)):
        for backend in ("cpu", "torch"):
            assert torch.equal(dequantize_ids(weight, ids, backend=backend), w[ids]), backend
    if qtype in REPACKED_TYPES:
        with pytest.raises(ValueError, match=r"embedding ids must be in 0\.\.20"):
            dequantize_ids(weight, torch.tensor([3, 21]), backend="cpu")
