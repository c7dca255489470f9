"""int8 KV caches (per-channel K, per-token V scales): the torch reference's write rules, and the C kernels against
it.

Caches are filled the way an engine fills them (`testing.write_rounds`: a prompt chunk, then single tokens, then
more chunks, all sequences in one call, a padding row in each), so blocks fill over several calls. Unwritten slots
hold random bytes, every scale starts NaN, and outputs are preallocated full of NaN: a kernel that reads what
it must not, or skips an element, fails. Contexts cross block boundaries.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from pagoda.pagedkernel import cpu_backend, kv_quant
from pagoda.pagedkernel.cbuild import for_march
from pagoda.pagedkernel.cpu_backend import CpuBackend
from pagoda.pagedkernel.testing import AttentionConfig as Case
from pagoda.pagedkernel.testing import (
    PagedCase,
    QuantizedCase,
    make_case,
    quantize_case,
    reference_attention,
    relative_error,
)
from pagoda.pagedkernel.torch_backend import TorchBackend
from torch import Tensor

TORCH = TorchBackend()
CASES = [
    Case(64, 8, 1, None, None),
    Case(64, 16, 4, 32, None),
    Case(128, 16, 2, None, 30.0),
    Case(40, 4, 3, 7, None),
]
DTYPES = [torch.float32, torch.bfloat16]
# Against the float64 attention over the very values the int8 cache holds: only the kernels' own rounding.
DEQUANT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# Against the attention over the unquantized values: int8's rounding (a step of amax / 127 per element).
QUANT_TOLERANCE = 0.03


@pytest.fixture(scope="module")
def cpu() -> CpuBackend:
    """One cpu backend for the module, so each library is loaded once."""
    return CpuBackend()


def _case(case: Case, dtype: torch.dtype, seed: int = 0) -> PagedCase:
    bs = case.block_size
    seqs = [(1, 1), (bs, bs), (bs + 1, 3), (3 * bs + 5, 2 * bs), (150, 1)]
    return make_case(
        seqs,
        num_heads=2 * case.group,
        num_kv_heads=2,
        head_dim=case.head_dim,
        block_size=bs,
        dtype=dtype,
        seed=seed,
        poison_unused=True,
    )


def _quantize(backend: TorchBackend, c: PagedCase) -> QuantizedCase:
    def write(
        key: Tensor, value: Tensor, k: Tensor, v: Tensor, slots: Tensor, k_scale: Tensor, v_scale: Tensor
    ) -> None:
        backend.reshape_and_cache(key, value, k, v, slots, k_scale=k_scale, v_scale=v_scale)

    return quantize_case(c, write)


def _written(qc: QuantizedCase) -> tuple[Tensor, Tensor]:
    """Flat slot mask of every written slot, and the mask of blocks that hold any."""
    bs = qc.k_cache.shape[1]
    slots = torch.zeros(qc.k_cache.shape[0] * bs, dtype=torch.bool)
    for i, ctx in enumerate(qc.case.context_lens.tolist()):
        pos = torch.arange(ctx)
        slots[qc.case.block_tables[i].long()[pos // bs] * bs + pos % bs] = True
    return slots, slots.view(-1, bs).any(dim=1)


def test_value_rule_gives_each_row_its_own_scale_and_never_clamps() -> None:
    """A value row's scale is its absolute maximum / 127, whatever else its block holds; later rows change
    nothing."""
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.int8)
    scales = torch.full((2, 4, 1), float("nan"))
    first = torch.linspace(-1.0, 1.0, 8).view(1, 1, 8)
    kv_quant.write_int8_values(first, cache, scales, torch.tensor([4]))  # block 1, offset 0
    assert scales[1, 0, 0].item() == pytest.approx(1.0 / 127)
    assert cache[1, 0, 0, 0].item() == -127 and bool(torch.isnan(scales[0]).all())  # block 0 untouched
    before = cache[1, 0].clone()
    kv_quant.write_int8_values(4.0 * first, cache, scales, torch.tensor([5]))  # 4x larger: its own scale
    assert scales[1, 1, 0].item() == pytest.approx(4.0 / 127)
    assert cache[1, 1, 0, 0].item() == -127  # not clamped
    assert torch.equal(cache[1, 0], before) and scales[1, 0, 0].item() == pytest.approx(
        1.0 / 127
    )  # untouched
    small = 0.5 * first
    kv_quant.write_int8_values(small, cache, scales, torch.tensor([6]))  # smaller: the full int8 range again
    assert scales[1, 2, 0].item() == pytest.approx(0.5 / 127) and cache[1, 2, 0, 0].item() == -127
    zeros = torch.zeros(1, 1, 8)
    kv_quant.write_int8_values(zeros, cache, scales, torch.tensor([0]))  # an all-zero row: a positive scale
    assert scales[0, 0, 0].item() > 0 and bool((cache[0, 0] == 0).all())
    # Rows are within half a step of their values: |x - q * scale| <= scale / 2.
    slots = torch.tensor([1, 2, 3, 7, 6])
    rows = torch.randn(5, 1, 8) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 7.0]).view(5, 1, 1)
    kv_quant.write_int8_values(rows, cache, scales, slots)
    step = scales.view(-1, 1)[slots][..., None]
    assert bool(((cache.view(-1, 1, 8)[slots].float() * step - rows).abs() <= step / 2 * 1.0001).all())


def test_key_rule_scales_each_channel_and_requantizes_only_the_grown_ones() -> None:
    """A key block's first rows set one scale per channel (amax / 127 rounded up to bfloat16); a later row larger in
    one channel raises that channel's scale and requantizes that channel's earlier rows only; a smaller channel
    keeps its own range."""
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.int8)
    scales = torch.full((2, 1, 8), float("nan"), dtype=torch.bfloat16)
    first = torch.linspace(1.0, 8.0, 8).view(1, 1, 8)  # channel c has magnitude c + 1
    kv_quant.write_int8_keys(first, cache, scales, torch.tensor([4]))  # block 1, offset 0
    expected = kv_quant.ceil_bfloat16(first[0, 0] / 127)
    assert torch.equal(scales[1, 0].float(), expected) and bool(torch.isnan(scales[0]).all())
    assert bool((expected >= first[0, 0] / 127).all()) and bool((expected <= first[0, 0] / 127 * 1.008).all())
    assert bool((cache[1, 0, 0] >= 126).all())  # every channel uses (nearly) the full range, none clamps
    grown = first.clone()
    grown[0, 0, 0] = 4.0  # channel 0 grows 4x, the others stay
    before = cache[1, 0, 0].clone()
    kv_quant.write_int8_keys(grown, cache, scales, torch.tensor([5]))
    new0 = kv_quant.ceil_bfloat16(torch.tensor([4.0 / 127]))[0]
    assert scales[1, 0, 0].float().item() == new0.item()
    assert torch.equal(scales[1, 0, 1:].float(), expected[1:])  # the other channels' scales unchanged
    ratio = torch.tensor(expected[0].item()) / new0  # float32, as the rule computes it
    assert cache[1, 0, 0, 0].item() == torch.round(before[0].float() * ratio).item()  # requantized
    assert torch.equal(cache[1, 0, 0, 1:], before[1:])  # the other channels not
    assert cache[1, 1, 0, 0].item() == torch.round(torch.tensor(4.0) / new0).item()  # not clamped
    kv_quant.write_int8_keys(0.5 * first, cache, scales, torch.tensor([4]))  # offset 0 again: a fresh block
    assert torch.equal(scales[1, 0].float(), kv_quant.ceil_bfloat16(0.5 * first[0, 0] / 127))
    kv_quant.write_int8_keys(
        torch.zeros(1, 1, 8), cache, scales, torch.tensor([0])
    )  # all zero: positive scales
    assert bool((scales[0, 0] > 0).all()) and bool((cache[0, 0] == 0).all())


def test_ceil_bfloat16_never_rounds_down() -> None:
    """Every float32 rounds up to the nearest bfloat16 at or above it (bfloat16 values stay)."""
    x = torch.rand(10_000) * torch.logspace(-30, 30, 10_000)
    up = kv_quant.ceil_bfloat16(x)
    assert bool((up >= x).all()) and torch.equal(up.to(torch.bfloat16).float(), up)
    assert bool((up <= x * (1 + 2**-7)).all())
    exact = x.to(torch.bfloat16).float()
    assert torch.equal(kv_quant.ceil_bfloat16(exact), exact)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_value_writes_split_into_calls_give_the_bytes_of_one_call(cpu: CpuBackend, backend: str) -> None:
    """Value rows written one call at a time, or in uneven chunks across blocks, give one call's bytes and
    scales (no requantization); the keys stay within their grown scales' rounding."""
    ops = cpu if backend == "cpu" else TORCH
    gen = torch.Generator().manual_seed(3)
    n, bs, heads, dim = 37, 8, 2, 16
    key = torch.randn(n, heads, dim, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    value = torch.randn(n, heads, dim, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    slots = torch.arange(n) + 3  # in order, as a sequence fills its blocks, starting mid-block
    results = []
    for cuts in ([0, n], [0, 1, 2, 9, 10, 30, n], list(range(n + 1))):
        k = torch.zeros(8, bs, heads, dim, dtype=torch.int8)
        v = torch.zeros_like(k)
        ks, vs = torch.ones(8, heads, dim, dtype=torch.bfloat16), torch.zeros(8, bs, heads)
        for a, b in itertools.pairwise(cuts):
            ops.reshape_and_cache(key[a:b], value[a:b], k, v, slots[a:b], k_scale=ks, v_scale=vs)
        results.append((k, v, ks, vs))
    for other in results[1:]:
        assert torch.equal(results[0][1], other[1]) and torch.equal(results[0][3], other[3])
        for ours in (results[0], other):  # keys: each within a step of its scale (at most one per growth)
            step = ours[2][slots // bs].float()
            deq = ours[0].view(-1, heads, dim)[slots].float() * step
            assert bool(((deq - key.float()).abs() <= step * 1.5).all())
    assert bool((results[0][3].view(-1, heads)[slots] > 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_c_write_equals_the_torch_reference_bitwise(cpu: CpuBackend, case: Case, dtype: torch.dtype) -> None:
    """The C int8 write gives the torch reference's bytes and scales in every written slot and used block."""
    c = _case(case, dtype)
    ours, ref = _quantize(cpu, c), _quantize(TORCH, c)
    slots, blocks = _written(ref)
    row = c.k_cache.shape[2] * c.k_cache.shape[3]
    for a, b in ((ours.k_cache, ref.k_cache), (ours.v_cache, ref.v_cache)):
        assert torch.equal(a.view(-1, row)[slots], b.view(-1, row)[slots])
    heads = c.k_cache.shape[2]
    assert torch.equal(ours.k_scale[blocks], ref.k_scale[blocks])
    assert torch.equal(ours.v_scale.view(-1, heads)[slots], ref.v_scale.view(-1, heads)[slots])
    assert bool((ref.k_scale[blocks] > 0).all()) and bool((ref.v_scale.view(-1, heads)[slots] > 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_int8_attention_matches_reference(cpu: CpuBackend, case: Case, dtype: torch.dtype) -> None:
    """Prefill and decode over an int8 cache: C and torch against float64 attention over the cache's values,
    and within int8's rounding of the attention over the unquantized K/V."""
    c = _case(case, dtype)
    qc = _quantize(TORCH, c)
    window, softcap = case.sliding_window, case.logit_softcap
    exact = reference_attention(qc.dequantized(), sliding_window=window, logit_softcap=softcap)
    unquantized = reference_attention(c, sliding_window=window, logit_softcap=softcap)
    args = (c.q, qc.k_cache, qc.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    outs = {}
    for backend in (cpu, TORCH):
        out = torch.full_like(c.q, float("nan"))
        got = backend.paged_prefill_attention(
            *args,
            sliding_window=window,
            logit_softcap=softcap,
            out=out,
            k_scale=qc.k_scale,
            v_scale=qc.v_scale,
        )
        assert got is out and out.dtype == dtype
        assert relative_error(out, exact) < DEQUANT_TOLERANCE[dtype], backend.name
        assert relative_error(out, unquantized) < QUANT_TOLERANCE, backend.name
        outs[backend.name] = out
    assert relative_error(outs["cpu"], outs["torch"].double()) < DEQUANT_TOLERANCE[dtype]
    # Decode: one query per sequence, at its last position.
    last = c.query_start_loc[1:].long() - 1
    q = c.q[last].contiguous()
    decode_args = (q, qc.k_cache, qc.v_cache, c.block_tables, c.context_lens, c.scale)
    for backend in (cpu, TORCH):
        out = torch.full_like(q, float("nan"))
        backend.paged_decode_attention(
            *decode_args,
            sliding_window=window,
            logit_softcap=softcap,
            out=out,
            k_scale=qc.k_scale,
            v_scale=qc.v_scale,
        )
        assert relative_error(out, exact[last]) < DEQUANT_TOLERANCE[dtype], backend.name


def test_int8_cache_is_built_as_its_own_library(cpu: CpuBackend) -> None:
    """The C kernel runs int8 caches itself (its own build), not through the torch fallback."""
    c = _case(CASES[0], torch.float32)
    _quantize(cpu, c)
    kernels = cpu.kernels(torch.float32, torch.int8)
    assert kernels is not None and kernels.reshape_and_cache_int8 is not None
    assert cpu.kernels(torch.float32).reshape_and_cache_int8 is None  # type: ignore[union-attr]


def test_scales_are_required_for_int8_and_refused_for_float() -> None:
    """An int8 cache without scales, or a float cache with them, is a caller's bug: asserted, not guessed."""
    c = _case(CASES[0], torch.float32)
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    scale = torch.ones(c.k_cache.shape[0], c.k_cache.shape[1], c.k_cache.shape[2])  # a float cache: any shape
    with pytest.raises(AssertionError, match="takes no scales"):
        TORCH.paged_prefill_attention(*args, k_scale=scale, v_scale=scale)
    int8 = c.k_cache.to(torch.int8)
    with pytest.raises(AssertionError, match="needs k_scale"):
        TORCH.paged_prefill_attention(c.q, int8, int8, *args[3:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_generic_c_build_agrees_with_the_native_one(cpu: CpuBackend, dtype: torch.dtype) -> None:
    """The int8 kernel built for a CPU without AVX2 (the generic vector code, not the AVX2 int8 loads) computes
    what the native build computes, within float32 rounding (FMA contraction differs), and the same writes."""
    c = _case(CASES[1], dtype)
    qc = _quantize(cpu, c)
    generic_flags = for_march(cpu_backend.CFLAGS, "x86-64")
    generic = cpu_backend.load(
        cpu_backend.build(dtype, int8_cache=True, cflags=generic_flags), int8_cache=True
    )
    native = cpu.kernels(dtype, torch.int8)
    assert native is not None
    args = (
        c.q,
        qc.k_cache,
        qc.v_cache,
        c.block_tables,
        c.query_start_loc,
        c.context_lens,
        c.scale,
        32,
        None,
        None,
    )
    ours = cpu_backend._attention(*args, generic, qc.k_scale, qc.v_scale)
    theirs = cpu_backend._attention(*args, native, qc.k_scale, qc.v_scale)
    assert relative_error(ours, theirs.double()) < DEQUANT_TOLERANCE[dtype]
