"""The C op of a whole LoRA layer (`pagoda_lora_apply`, `LoRALayer` on the CPU): its register blocks (1-4 rows
of a slot, pairs of A rows and an odd one, full and partial output tiles, tails of in_features), its threads, the
vector rounding of y and prefill-sized batches, against the float64 reference and against itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from pagoda.pagedkernel.lora import cpu_lora
from pagoda.pagedkernel.lora.fused import LoRALayer
from pagoda.pagedkernel.lora.testing import LoRACase, add_error_bound, make_case, reference_add
from pagoda.pagedkernel.testing import c_kernel_or_skip

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _c_kernel() -> None:
    """Skip where this machine has no C compiler; a C kernel that fails to compile fails every test, with gcc's
    output (never a skip)."""
    c_kernel_or_skip(lambda: cpu_lora.kernels(torch.float32))


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch's pool at two threads for the test (the op splits large calls over it), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _layer(case: LoRACase) -> LoRALayer:
    """A one-shard C layer over the case's pool (B rank-major, as the server's pools are)."""
    layer = LoRALayer(case.a, [case.b.transpose(1, 2).contiguous()], [0], backend="cpu")
    assert layer.runs_in_c
    return layer


def assert_within_bound(y: torch.Tensor, case: LoRACase) -> None:
    """y (after the add) is reference_add's float64 result of the same stored inputs within `add_error_bound`:
    one rounding to y's dtype (bfloat16: 2^-8 = 0.39% of each output, float16 2^-11, float32 2^-24) plus float32
    accumulation; rows without an adapter exactly as they were."""
    error = (y.double() - reference_add(case, 0)).abs()
    bound = add_error_bound(case, 0)
    assert bool((error <= bound).all()), f"{float((error / bound)[bound > 0].max()):.3f} x the bound"


def _scaled(case: LoRACase) -> LoRACase:
    """The case with unit scales (the layer folds scales into B, the reference applies them)."""
    return LoRACase(case.x, case.a, case.b, case.slots, torch.ones_like(case.scales), case.y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("in_features", "out_features", "rank"),  # tails of in_features, partial tiles, odd ranks
    [(64, 128, 16), (70, 150, 5), (33, 64, 1), (40, 200, 3)],
)
def test_every_block_size_matches_the_reference(
    dtype: torch.dtype, in_features: int, out_features: int, rank: int
) -> None:
    """Slots holding 1 to 9 rows (every block remainder), interleaved with rows without an adapter."""
    case = _scaled(make_case(45, in_features, out_features, rank, 9, dtype=dtype, seed=in_features))
    slots = torch.tensor([s for s in range(9) for _ in range(s + 1)], dtype=torch.int64)
    slots = slots[torch.randperm(45, generator=torch.Generator().manual_seed(3))]
    slots[::7] = -1
    case = LoRACase(case.x, case.a, case.b, slots, case.scales, case.y)
    y = case.y.clone()
    _layer(case).apply(case.x, y, slots, [True])
    assert_within_bound(y, case)
    assert torch.equal(y[slots < 0], case.y[slots < 0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_does_not_depend_on_its_neighbours(dtype: torch.dtype) -> None:
    """Each row's bits are the same whether it shares its slot's block with others or is alone in the batch."""
    case = _scaled(make_case(23, 96, 192, 8, 3, dtype=dtype, seed=4))
    layer = _layer(case)
    together = case.y.clone()
    layer.apply(case.x, together, case.slots, [True])
    for t in range(0, 23, 5):
        alone = case.y[t : t + 1].clone()
        layer.apply(case.x[t : t + 1], alone, case.slots[t : t + 1], [True])
        assert torch.equal(alone[0], together[t])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_threads_give_the_same_bits(dtype: torch.dtype, two_threads: None) -> None:
    """A prefill-sized call (split over two threads) equals the same call on one thread, bit for bit, and the
    reference; rows past the old 64-row limit run in C too."""
    del two_threads
    case = _scaled(make_case(300, 256, 640, 16, 4, dtype=dtype, seed=5))
    layer = _layer(case)
    threaded = case.y.clone()
    layer.apply(case.x, threaded, case.slots, [True])
    torch.set_num_threads(1)
    single = case.y.clone()
    layer.apply(case.x, single, case.slots, [True])
    assert torch.equal(threaded, single)
    assert_within_bound(single, case)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_y_is_rounded_once_like_torch(dtype: torch.dtype) -> None:
    """With an exact delta (A picks one input, rank 1), y + delta is rounded as torch rounds a float32 sum, in
    full tiles (the vector store) and the partial one; NaN in a row with an adapter stays NaN."""
    g = torch.Generator().manual_seed(6)
    rows, width = 12, 64 * 3 + 5
    x = torch.randn(rows, 32, generator=g).to(dtype)
    a = torch.zeros(1, 1, 32, dtype=dtype)
    a[0, 0, 7] = 1.0
    b = torch.randn(1, width, 1, generator=g).to(dtype)
    y = (torch.randn(rows, width, generator=g) * 4).to(dtype)
    y[3, 10], y[5, width - 1] = float("nan"), float("nan")
    slots = torch.zeros(rows, dtype=torch.int64)
    want = (y.float() + x[:, 7:8].float() * b[0, :, 0].float()).to(dtype)
    got = y.clone()
    LoRALayer(a, [b.transpose(1, 2).contiguous()], [0], backend="cpu").apply(x, got, slots, [True])
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[3, 10].isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
