"""The fused layer ops (pagoda.pagedkernel.fused): the C kernels against the torch specification."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from pagoda.pagedkernel.cbuild import cpu_flags, for_march
from pagoda.pagedkernel.fused import act_and_mul, add_rms_norm, cpu_fused, rms_norm, rotary, torch_fused
from torch import Tensor

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Each row's sum of squares is added in another order than torch's: float32 results may differ in the last bits,
# and a bfloat16 / float16 result may round the other way, one unit in the last place, on a few elements.
ULP = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
MAX_FLIPPED = 0.01


def assert_matches(got: Tensor, want: Tensor) -> None:
    """got equals want up to last-place roundings (float32: a few ulps anywhere; else on few elements)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any() and not want.isnan().any()
    diff = (got.float() - want.float()).abs()
    # Relative to each value, plus a few ulps of the largest (a sum near zero cancels its terms' roundings).
    floor = 4 * ULP[got.dtype] * float(want.float().abs().max())
    bound = 2 * ULP[got.dtype] * want.float().abs() + floor
    assert bool((diff <= bound).all()), float((diff / bound).max())
    if got.dtype != torch.float32:
        # Last-place flips are counted where the values are held relatively: below the floor a value is the
        # residue of a cancellation (GELU's 1 + tanh z at z ~ -9: torch's float32 gives 0 where the kernel's
        # exp form keeps ~1e-7; both within the floor), not a rounding of the same value.
        held = want.float().abs() > floor
        assert float(((got != want) & held).float().mean()) <= MAX_FLIPPED


@pytest.fixture(autouse=True)
def _needs_compiler() -> None:
    """The C kernels are what these tests check: without a compiler, or with one that fails (its stderr in the
    error), every test fails."""
    cpu_fused.kernels(torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize(("rows", "dim"), [(1, 640), (3, 17), (37, 100), (5, 8)])
def test_rms_norm_matches_the_torch_specification(
    dtype: torch.dtype, unit_offset: bool, rows: int, dim: int
) -> None:
    """Every row length (16-lane bodies and tails), both weight forms, each storage dtype."""
    gen = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    w = torch.randn(dim, generator=gen).to(dtype)
    want = torch_fused.rms_norm(x, w, 1e-6, unit_offset)
    assert_matches(rms_norm(x, w, 1e-6, unit_offset=unit_offset, backend="cpu"), want)
    # Leading dimensions and a transposed (non-contiguous) input take the same path.
    x3 = x.view(rows, 1, dim).expand(rows, 2, dim)
    assert_matches(
        rms_norm(x3, w, 1e-6, unit_offset=unit_offset, backend="cpu"), want[:, None].expand(-1, 2, -1)
    )
    xt = x.t().contiguous().t()
    assert_matches(rms_norm(xt, w, 1e-6, unit_offset=unit_offset, backend="cpu"), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("with_pre", [True, False])
def test_add_rms_norm_matches(dtype: torch.dtype, unit_offset: bool, with_pre: bool) -> None:
    """Llama's add-then-norm and Gemma's sandwich (norm the branch, add, norm); the sum is exact."""
    gen = torch.Generator().manual_seed(7)
    rows, dim = 19, 96
    x, r = (torch.randn(rows, dim, generator=gen).to(dtype) for _ in range(2))
    w, pre = (torch.randn(dim, generator=gen).to(dtype) for _ in range(2))
    pre_weight = pre if with_pre else None
    total, normed = add_rms_norm(x, r, w, 1e-5, unit_offset=unit_offset, pre_weight=pre_weight, backend="cpu")
    want_total, want_normed = torch_fused.add_rms_norm(x, r, w, 1e-5, unit_offset, pre_weight)
    if with_pre:
        assert_matches(total, want_total)
    else:
        assert torch.equal(total, want_total)
    assert_matches(normed, want_normed)
    assert torch.equal(r, r.clone())  # the residual is read, never written


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_bit_exact_on_strided_views(dtype: torch.dtype) -> None:
    """q and k as views into one qkv row (strided), rotated exactly as torch does: no sum, no reordering."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, head_dim = 6, 4, 2, 48
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]
    for x in (q, k):
        got = rotary(x, cos, sin, backend="cpu")
        assert got.is_contiguous()
        assert torch.equal(got, torch_fused.rotary(x, cos, sin, None, 0.0, False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [True, False])
def test_norm_then_rotary_matches(dtype: torch.dtype, unit_offset: bool) -> None:
    """The q/k norm fused before the rotary equals the two torch ops in a row."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 3, 64, generator=gen).to(dtype)
    w = torch.randn(64, generator=gen).to(dtype)
    angles = torch.rand(9, 32, generator=gen) * 6
    cos, sin = angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]
    got = rotary(x, cos, sin, norm_weight=w, eps=1e-6, unit_offset=unit_offset, backend="cpu")
    assert_matches(got, torch_fused.rotary(x, cos, sin, w, 1e-6, unit_offset))


def test_nan_rows_stay_nan_and_others_are_untouched() -> None:
    """A NaN in one row makes that row NaN (as torch), and no other."""
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    x[2, 5] = float("nan")
    w = torch.randn(32, dtype=torch.bfloat16)
    got = rms_norm(x, w, 1e-6, unit_offset=True, backend="cpu")
    assert bool(got[2].isnan().all()) and not got[[0, 1, 3]].isnan().any()


def test_auto_picks_the_kernel_and_falls_back_to_torch() -> None:
    """`auto` runs the C kernel for CPU float tensors and torch for a dtype it lacks (float64)."""
    x64 = torch.randn(2, 8, dtype=torch.float64)
    w64 = torch.randn(8, dtype=torch.float64)
    assert torch.equal(
        rms_norm(x64, w64, 1e-6, unit_offset=False), torch_fused.rms_norm(x64, w64, 1e-6, False)
    )
    x = torch.randn(2, 8)
    assert_matches(
        rms_norm(x, torch.ones(8), 1e-6, unit_offset=False),
        torch_fused.rms_norm(x, torch.ones(8), 1e-6, False),
    )


def test_bad_arguments_are_named() -> None:
    """Shapes, backends and dtypes that cannot run raise ValueError naming what is wrong."""
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        rms_norm(x, torch.ones(7), 1e-6, unit_offset=False)
    with pytest.raises(ValueError, match="unknown fused-op backend"):
        rms_norm(x, torch.ones(8), 1e-6, unit_offset=False, backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one dtype"):
        rms_norm(x.double(), torch.ones(8), 1e-6, unit_offset=False, backend="cpu")
    with pytest.raises(ValueError, match="even head_dim"):
        rotary(torch.randn(2, 1, 7), torch.randn(2, 1, 3), torch.randn(2, 1, 3))
    with pytest.raises(ValueError, match="cos and sin"):
        rotary(torch.randn(2, 1, 8), torch.randn(2, 1, 3), torch.randn(2, 1, 4))
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-6, unit_offset=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
@pytest.mark.parametrize(("rows", "inner"), [(1, 2048), (5, 37), (3, 16)])
def test_act_and_mul_matches(dtype: torch.dtype, activation: str, rows: int, inner: int) -> None:
    """GeGLU / SwiGLU from the fused gate-up output: each half read in place, tails included; float32 within a
    few ulps of torch's exp and tanh (the tiny values where 1 + tanh z cancels aside), bfloat16 / float16 equal
    but for rare last-place roundings."""
    gen = torch.Generator().manual_seed(rows * inner)
    x = (torch.randn(rows, 2 * inner, generator=gen) * 4).to(dtype)
    got = act_and_mul(x, activation, backend="cpu")  # type: ignore[arg-type]
    assert_matches(got, torch_fused.act_and_mul(x, activation))
    wide = torch.randn(rows, 2 * inner + 8, generator=gen).to(dtype)[:, : 2 * inner]  # rows apart by a stride
    assert_matches(act_and_mul(wide, activation, backend="cpu"), torch_fused.act_and_mul(wide, activation))  # type: ignore[arg-type]


def _bits(t: Tensor) -> Tensor:
    """The stored bits of a float32 / bfloat16 tensor (NaN compares equal to itself)."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("march", ["x86-64-v4", "x86-64-v3", "x86-64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_other_builds_agree(
    march: str, dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library built for AVX-512, AVX2 (its comparisons in halves of eight lanes) and plain x86-64 gives the
    native build's bits for GELU and SiLU (gates of -200 to 200 and NaN: past both of exp's clamps) and for a
    residual add + norm; every target compiles here (a compile error fails), one this CPU cannot run is not run."""
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 target flags")
    # first: the native library is built and cached for the process in the real cache, not in tmp_path
    native = cpu_fused.kernels(dtype)
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    flags = for_march(cpu_fused.CFLAGS, march)
    library = cpu_fused.build(dtype, flags)
    if march == "x86-64-v4" and "avx512bw" not in cpu_flags():
        pytest.skip("this CPU cannot run -march=x86-64-v4 (built only)")
    libs = (native, cpu_fused.load(library))
    gen = torch.Generator().manual_seed(3)
    rows, inner = 5, 53
    x = torch.randn(rows, 2 * inner, generator=gen) * 20
    x[0, :6] = torch.tensor([float("nan"), 200.0, -200.0, 100.0, -100.0, 0.0])
    x = x.to(dtype)
    for kind in cpu_fused.ACTIVATION_IDS.values():
        outs = [torch.empty(rows, inner, dtype=dtype) for _ in libs]
        for lib, y in zip(libs, outs, strict=True):
            assert lib.act_and_mul(x.data_ptr(), rows, x.stride(0), inner, kind, y.data_ptr(), 1) == 0
        assert torch.equal(_bits(outs[0]), _bits(outs[1]))
    finite = torch.nan_to_num(x.float()).to(dtype)
    r, w = (
        torch.randn(rows, 2 * inner, generator=gen).to(dtype),
        torch.randn(2 * inner, generator=gen).to(dtype),
    )
    got = [(torch.empty_like(finite), torch.empty_like(finite)) for _ in libs]
    for lib, (total, normed) in zip(libs, got, strict=True):
        args = (
            finite.data_ptr(),
            finite.stride(0),
            r.data_ptr(),
            rows,
            2 * inner,
            None,
            w.data_ptr(),
            1e-6,
            1,
        )
        assert lib.add_norm(*args, total.data_ptr(), normed.data_ptr(), 1) == 0
    assert torch.equal(_bits(got[0][0]), _bits(got[1][0])) and torch.equal(_bits(got[0][1]), _bits(got[1][1]))


def test_act_and_mul_propagates_nan_and_saturates() -> None:
    """A NaN gate gives NaN; very large gates give x * up (GELU and SiLU saturate), very negative ones ~0."""
    x = torch.tensor([[float("nan"), 200.0, -200.0, 1.0, 1.0, 3.0, 5.0, 7.0]])
    for activation in ("gelu_tanh", "silu"):
        got = act_and_mul(x, activation, backend="cpu")
        assert bool(got[0, 0].isnan()) and float(got[0, 1]) == 200.0 * 3.0 and abs(float(got[0, 2])) < 1e-30


def test_act_and_mul_bad_arguments() -> None:
    """An unknown activation or an odd width is a ValueError naming it."""
    with pytest.raises(ValueError, match="activation must be one of"):
        act_and_mul(torch.randn(2, 8), "relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[rows, 2 \* inner\]"):
        act_and_mul(torch.randn(2, 7), "silu")
