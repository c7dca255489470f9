"""The batched LoRA ops (`pagoda.pagedkernel.lora`) on every CPU-runnable backend against the float64 reference:
mixed slots, rows without an adapter (left untouched, even when NaN), fused-projection column offsets, dtypes."""

from __future__ import annotations

import pytest
import torch
from pagoda.pagedkernel.backend import triton_interpreted
from pagoda.pagedkernel.lora import add_lora, lora_embedding_shrink, lora_expand, lora_shrink
from pagoda.pagedkernel.lora.fused import LoRALayer
from pagoda.pagedkernel.lora.ops import LoRABackendName
from pagoda.pagedkernel.lora.testing import (
    LoRACase,
    add_error_bound,
    make_case,
    make_embedding_case,
    reference_add,
    reference_embedding_shrink,
    reference_shrink,
)
from torch import Tensor

BACKENDS: list[LoRABackendName] = ["torch", "cpu", "triton"]


def bound_for(
    case: LoRACase, offset: int, backend: LoRABackendName, *, delta_rounded: bool = False
) -> Tensor:
    """`add_error_bound` of the case for this backend: Triton's CPU interpreter chops float32 to bfloat16 (a
    whole ulp) where every other backend, and Triton on a GPU, rounds to nearest (half an ulp)."""
    truncating = backend == "triton" and triton_interpreted() and case.y.dtype == torch.bfloat16
    return add_error_bound(case, offset, truncating=truncating, delta_rounded=delta_rounded)


def assert_within(got: Tensor, want: Tensor, bound: Tensor) -> None:
    """|got - want| <= bound everywhere (bound 0: equal), with the worst ratio in the message."""
    error = (got.double() - want).abs()
    ratio = float((error / bound)[bound > 0].max()) if bool((bound > 0).any()) else 0.0
    assert bool((error <= bound).all()), f"{ratio:.3f} x the bound"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_shrink_matches_the_reference(backend: LoRABackendName, dtype: torch.dtype) -> None:
    """h per row from its own slot's A, scaled; rows without an adapter are exactly 0. h is float32 from the
    stored inputs (products of bfloat16 or float16 exact in float32): only float32 accumulation of K products and
    the scale's product, |err| <= gamma_{K+1} |s| (|A| . |x|) (Higham, gamma_n = n 2^-24 / (1 - n 2^-24))."""
    case = make_case(13, 70, 24, 5, 3, dtype=dtype, seed=1)
    h = lora_shrink(case.x, case.a, case.slots, case.scales, backend=backend)
    assert h.dtype == torch.float32
    want = reference_shrink(case)
    n = case.x.shape[1] + 1
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    active = (case.slots >= 0).double()[:, None]
    magnitude = torch.stack(
        [
            case.scales[max(s, 0)].double().abs() * (case.a[max(s, 0)].double().abs() @ xt.double().abs())
            for s, xt in zip(case.slots.tolist(), case.x, strict=True)
        ]
    )
    assert_within(h, want, gamma * magnitude * active)
    assert bool((h[case.slots < 0] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offset", [0, 11])
def test_add_lora_matches_the_reference(backend: LoRABackendName, dtype: torch.dtype, offset: int) -> None:
    """A slice of a wider (fused) output gets each row's delta; columns outside it are untouched."""
    case = make_case(17, 40, 90, 8, 4, dtype=dtype, width=120, seed=2)
    y = case.y.clone()
    add_lora(y, case.x, case.a, case.b, case.slots, case.scales, offset=offset, backend=backend)
    assert_within(y, reference_add(case, offset), bound_for(case, offset, backend))
    outside = torch.ones(120, dtype=torch.bool)
    outside[offset : offset + 90] = False
    assert torch.equal(y[:, outside], case.y[:, outside])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_an_adapter_are_never_touched(backend: LoRABackendName) -> None:
    """NaN-poisoned base rows of no-adapter rows stay NaN bit for bit, every adapter row becomes finite."""
    case = make_case(20, 33, 21, 4, 2, seed=3)
    y = case.y.clone()
    none = case.slots < 0
    assert bool(none.any()) and bool((~none).any())
    y[none] = float("nan")
    h = lora_shrink(case.x, case.a, case.slots, case.scales, backend=backend)
    lora_expand(h, case.b, case.slots, y, backend=backend)
    assert bool(y[none].isnan().all())
    assert_within(y[~none], reference_add(case, 0)[~none], bound_for(case, 0, backend)[~none])


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_without_adapter_is_the_identity(backend: LoRABackendName) -> None:
    """A batch where no row has an adapter leaves y as it was (and h zero), whatever the pool holds (NaN)."""
    case = make_case(6, 16, 16, 4, 2, seed=4)
    slots = torch.full((6,), -1, dtype=torch.int64)
    y = case.y.clone()
    a = torch.full_like(case.a, float("nan"))
    b = torch.full_like(case.b, float("nan"))
    add_lora(y, case.x, a, b, slots, case.scales, backend=backend)
    assert torch.equal(y, case.y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_slot_outside_the_pool_is_refused(backend: LoRABackendName) -> None:
    """An out-of-range slot is an IndexError before anything is written."""
    case = make_case(4, 16, 16, 4, 2, seed=5)
    slots = torch.tensor([0, 1, 2, -1])
    y = case.y.clone()
    with pytest.raises(IndexError, match="out of range"):
        add_lora(y, case.x, case.a, case.b, slots, case.scales, backend=backend)
    assert torch.equal(y, case.y)


def test_mismatched_shapes_are_refused() -> None:
    """Shapes that do not line up name the op and the tensors."""
    case = make_case(4, 16, 16, 4, 2)
    with pytest.raises(ValueError, match="lora_shrink"):
        lora_shrink(case.x[:, :8], case.a, case.slots, case.scales)
    h = lora_shrink(case.x, case.a, case.slots, case.scales)
    with pytest.raises(ValueError, match="lora_expand"):
        lora_expand(h, case.b, case.slots, case.y, offset=4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_embedding_shrink_matches_the_reference(backend: LoRABackendName, dtype: torch.dtype) -> None:
    """An embedding adapter's h is its slot's A row of the token, scaled; rows without an adapter are 0 even when
    the pool is NaN."""
    case = make_embedding_case(90, 37, 6, 3, dtype=dtype, seed=6)
    h = lora_embedding_shrink(case.ids, case.a, case.slots, case.scales, backend=backend)
    assert h.dtype == torch.float32 and h.shape == (90, 6)
    torch.testing.assert_close(h.double(), reference_embedding_shrink(case), rtol=1e-6, atol=1e-6)
    assert bool((h[case.slots < 0] == 0).all())
    none = torch.full_like(case.slots, -1)
    poisoned = torch.full_like(case.a, float("nan"))
    assert bool((lora_embedding_shrink(case.ids, poisoned, none, case.scales, backend=backend) == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_shrink_refuses_ids_and_slots_outside(backend: LoRABackendName) -> None:
    """A token id beyond the table (for a row with an adapter) or a slot beyond the pool is an IndexError; the id
    of a row without an adapter is never read."""
    case = make_embedding_case(4, 10, 4, 2, seed=7)
    slots = torch.tensor([0, 1, -1, 0])
    with pytest.raises(IndexError, match="vocabulary"):
        lora_embedding_shrink(torch.tensor([1, 2, 3, 10]), case.a, slots, case.scales, backend=backend)
    with pytest.raises(IndexError, match="out of range"):
        lora_embedding_shrink(case.ids, case.a, torch.tensor([0, 2, -1, 0]), case.scales, backend=backend)
    h = lora_embedding_shrink(torch.tensor([1, 2, 99, 3]), case.a, slots, case.scales, backend=backend)
    assert bool((h[2] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("out_features", [90, 64, 7])
def test_expand_of_a_rank_major_pool_matches_the_reference(
    backend: LoRABackendName, dtype: torch.dtype, out_features: int
) -> None:
    """B stored rank-major ([slots, rank, out], passed transposed: the engine's pool) gives the same delta as the
    output-major B, in a column slice of a wider output, outputs not a multiple of the vector width too."""
    case = make_case(19, 40, out_features, 8, 3, dtype=dtype, width=out_features + 30, seed=8)
    pool = case.b.transpose(1, 2).contiguous()  # [slots, rank, out]
    h = lora_shrink(case.x, case.a, case.slots, case.scales, backend=backend)
    y = case.y.clone()
    lora_expand(h, pool.transpose(1, 2), case.slots, y, offset=13, backend=backend)
    assert_within(y, reference_add(case, 13), bound_for(case, 13, backend))
    assert torch.equal(y[:, :13], case.y[:, :13])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens", [9, 70])  # a decode batch and a prefill-sized one
def test_fused_layer_matches_the_reference_per_shard(
    backend: LoRABackendName, dtype: torch.dtype, num_tokens: int
) -> None:
    """A three-shard pool (a fused q/k/v) in one `LoRALayer.apply`: each used shard's columns get the reference
    delta of its part of A and its B, an unused shard's columns (and rows without an adapter) are untouched."""
    sizes, offsets, rank, slots_n = (24, 8, 8), (0, 24, 32), 4, 3
    # One seed: the cases share x and slots (y, drawn after B, is made the first one's for all); each shard's A is
    # made its own (scaled by its index + 1).
    cases = [make_case(num_tokens, 40, n, rank, slots_n, dtype=dtype, width=40, seed=9) for n in sizes]
    cases = [
        LoRACase(c.x, (c.a.float() * (i + 1)).to(dtype), c.b, c.slots, torch.ones(slots_n), cases[0].y)
        for i, c in enumerate(cases)
    ]
    x, slots, y0 = cases[0].x, cases[0].slots, cases[0].y
    a = torch.cat([c.a for c in cases], dim=1).contiguous()  # every case shares x and slots (one seed)
    layer = LoRALayer(a, [c.b.transpose(1, 2).contiguous() for c in cases], offsets, backend=backend)
    y = y0.clone()
    layer.apply(x, y, slots, [True, False, True])
    want = y0.double().clone()
    bound = torch.zeros_like(want)  # each used shard's own columns: its bound (they do not overlap)
    for index in (0, 2):
        want += reference_add(cases[index], offsets[index]) - cases[index].y.double()
        bound += bound_for(cases[index], offsets[index], backend)
    assert_within(y, want, bound)
    assert torch.equal(y[:, 24:32], y0[:, 24:32]) and torch.equal(y[slots < 0], y0[slots < 0])
    with pytest.raises(IndexError, match="out of range"):
        layer.apply(x, y, torch.full_like(slots, slots_n), [True, True, True])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_layer_groups_equal_the_row_op(backend: LoRABackendName, dtype: torch.dtype) -> None:
    """Rows of a slot done as matmuls (`groups`, their rows -1 in `slots`) give the row op's result; the other
    rows still get theirs."""
    case = make_case(80, 40, 24, 4, 3, dtype=dtype, width=30, seed=10)
    slots = case.slots.clone()
    slots[10:50], slots[60:75] = 1, 2
    layer = LoRALayer(case.a, [case.b.transpose(1, 2).contiguous()], [3], backend=backend)
    want = case.y.clone()
    layer.apply(case.x, want, slots, [True])
    short = slots.clone()
    short[10:50], short[60:75] = -1, -1
    got = case.y.clone()
    groups: list[tuple[int, torch.Tensor | slice]] = [(1, torch.arange(10, 50)), (2, slice(60, 75))]
    layer.apply(case.x, got, short, [True], groups)
    whole = LoRACase(case.x, case.a, case.b, slots, torch.ones(3), case.y)
    exact = reference_add(whole, 3)
    row_op = bound_for(whole, 3, backend)
    # The index-list group adds a float32 delta rounded to y's dtype by index_add_ (a second rounding); the
    # run of rows (a slice) and the rows left to the row op round once.
    grouped = bound_for(whole, 3, backend, delta_rounded=True)
    grouped[torch.arange(60, 75)] = row_op[torch.arange(60, 75)]
    rest = torch.ones(80, dtype=torch.bool)
    rest[10:50], rest[60:75] = False, False
    grouped[rest] = row_op[rest]
    assert_within(want, exact, row_op)
    assert_within(got, exact, grouped)
