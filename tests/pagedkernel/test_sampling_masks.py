"""Sampling masks: every backend keeps exactly the tokens a sort-based reference keeps (min_p, then top_k, then
top_p; ties at a threshold all kept), on logits with ties, -inf entries, a row all -inf but one, in float32 and
bfloat16. The Triton kernel runs under TRITON_INTERPRET=1 on the CPU (see tests/conftest.py), on small shapes."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from pagoda.pagedkernel.sampling import SamplingTensors, get_sampler, triton_sampling
from pagoda.pagedkernel.sampling.testing import sorted_kept_mask, tricky_logits
from torch import Tensor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOP_K = [0, 1, 2, 7, 40, 10_000]
TOP_P = [1.0, 0.999, 0.9, 0.5, 0.05]
MIN_P = [0.0, 0.01, 0.3, 1.0]
TEMPERATURE = [0.4, 1.0, 1.7]


def _settings(rows: int, seed: int) -> tuple[list[float], list[int], list[float], list[float]]:
    """Per-row (temperature, top_k, top_p, min_p), cycling through every combination in a shuffled order."""
    combos = list(itertools.product(TEMPERATURE, TOP_K, TOP_P, MIN_P))
    order = torch.randperm(len(combos), generator=torch.Generator().manual_seed(seed)).tolist()
    picked = [combos[order[i % len(combos)]] for i in range(rows)]
    return [c[0] for c in picked], [c[1] for c in picked], [c[2] for c in picked], [c[3] for c in picked]


def _check_masks(
    kept_mask: Callable[[Tensor, SamplingTensors], Tensor],
    rows: int,
    vocab: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    """The kept mask equals the sort-based one on every row."""
    logits = tricky_logits(rows, vocab, dtype=dtype, seed=seed).to(DEVICE)
    temperature, top_k, top_p, min_p = _settings(rows, seed)
    params = SamplingTensors.build(
        temperature=temperature, keys=[0] * rows, top_k=top_k, top_p=top_p, min_p=min_p, device=DEVICE
    )
    mask = kept_mask(logits, params).cpu()
    x = logits.cpu().float() * params.inverse_temperature().cpu().unsqueeze(1)
    for i in range(rows):
        expected = sorted_kept_mask(x[i], top_k[i], top_p[i], min_p[i])
        assert torch.equal(mask[i], expected), (i, temperature[i], top_k[i], top_p[i], min_p[i])
        assert bool(mask[i].any())  # the most likely token is always kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_masks_match_a_sort(backend: str, dtype: torch.dtype) -> None:
    """Every (temperature, top_k, top_p, min_p) combination over 480 rows of 1,000 tokens."""
    if backend == "cpu" and DEVICE != "cpu":
        pytest.skip("the cpu backend runs on CPU tensors")
    _check_masks(get_sampler(backend, DEVICE).kept_mask, rows=480, vocab=1000, dtype=dtype, seed=1)


def test_cpu_masks_on_a_large_vocabulary() -> None:
    """Rows with more candidates than the C kernel selects among directly: its histogram path narrows them."""
    if DEVICE != "cpu":
        pytest.skip("the cpu backend runs on CPU tensors")
    _check_masks(get_sampler("cpu").kept_mask, rows=24, vocab=30_000, dtype=torch.float32, seed=2)


def test_flat_rows_use_the_histogram_path() -> None:
    """Near-uniform rows: the nucleus is most of the vocabulary, so top_p's chunk bound gives no pruning."""
    if DEVICE != "cpu":
        pytest.skip("the cpu backend runs on CPU tensors")
    rows, vocab = 8, 20_000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 0.3
    params = SamplingTensors.build(
        temperature=[1.0] * rows,
        keys=[0] * rows,
        top_k=[0, 0, 15_000, 9000, 0, 12_000, 0, 19_999],
        top_p=[0.95, 0.5, 1.0, 0.99, 0.2, 0.7, 0.999, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.6, 0.0],
    )
    mask = get_sampler("cpu").kept_mask(logits, params)
    x = logits * params.inverse_temperature().unsqueeze(1)
    for i in range(rows):
        expected = sorted_kept_mask(
            x[i], int(params.top_k[i]), float(params.top_p[i]), float(params.min_p[i])
        )
        assert torch.equal(mask[i], expected), i
    assert int(mask[0].sum()) > vocab // 2


def _cpu_masks_match_a_sort(logits: Tensor, top_p: list[float], top_k: list[int] | None = None) -> Tensor:
    """The cpu backend's kept mask, checked against the sort on every row (temperature 1, no min_p)."""
    rows = logits.shape[0]
    top_k = top_k or [0] * rows
    params = SamplingTensors.build(temperature=[1.0] * rows, keys=[0] * rows, top_k=top_k, top_p=top_p)
    mask = get_sampler("cpu").kept_mask(logits, params)
    for i in range(rows):
        assert torch.equal(mask[i], sorted_kept_mask(logits[i].float(), top_k[i], top_p[i], 0.0)), i
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_top_p_below_the_head_histogram(dtype: torch.dtype) -> None:
    """A row whose nucleus reaches more than 16 nats below its maximum: top_p's one-pass histogram covers only the
    16 nats below it, so the C kernel selects among the rest the slower way, with the same result."""
    if DEVICE != "cpu":
        pytest.skip("the cpu backend runs on CPU tensors")
    g = torch.Generator().manual_seed(5)
    vocab = 30_000
    logits = -16.5 - 2.0 * torch.rand(3, vocab, generator=g)  # 30,000 tokens 16.5-18.5 nats below
    logits[:, 7] = 0.0
    # the tail holds ~0.09% of the mass: a nucleus of 0.9995 reaches into it, one of 0.9 keeps the maximum alone
    mask = _cpu_masks_match_a_sort(logits.to(dtype), top_p=[0.9995, 0.99999, 0.9])
    assert 1 < int(mask[0].sum()) < vocab and int(mask[1].sum()) > int(mask[0].sum())
    assert int(mask[2].sum()) == 1


def test_top_p_threshold_among_many_ties() -> None:
    """5,000 tokens tied in the bucket that holds the threshold (the C kernel's gather buffer grows past its first
    1,024), on a vocabulary of Gemma 3's size and one past the 2^19 tokens its tail sums take in one block."""
    if DEVICE != "cpu":
        pytest.skip("the cpu backend runs on CPU tensors")
    g = torch.Generator().manual_seed(6)
    for vocab in (262_144, 600_000):
        logits = torch.randn(2, vocab, generator=g) - 12.0  # a tail of ~1e-5 each
        logits[:, :5000] = -1.0
        logits[:, 5000] = 0.0
        logits[1] = torch.randn(vocab, generator=g) * 1.5  # flat: the nucleus is most of the vocabulary
        mask = _cpu_masks_match_a_sort(logits, top_p=[0.5, 0.9])
        assert bool(mask[0, :5000].all()) and int(mask[0].sum()) == 5001  # the ties and the maximum
        assert int(mask[1].sum()) > vocab // 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_masks_match_a_sort(dtype: torch.dtype) -> None:
    """The Triton kernel (interpreted on the CPU): 16 rows of 200 tokens, in two blocks of 128 per row."""

    def kept_mask(logits: Tensor, params: SamplingTensors) -> Tensor:
        args = (params.inverse_temperature(), params.top_k, params.top_p, params.min_p, params.keys)
        mask = triton_sampling.run(logits, *args, with_mask=True, block=128)[2]
        assert mask is not None
        return mask

    get_sampler("triton", DEVICE)  # refuses a CPU device unless the kernels are interpreted
    _check_masks(kept_mask, rows=16, vocab=200, dtype=dtype, seed=4)


def test_greedy_rows_keep_the_first_maximum_only() -> None:
    """Temperature 0 (and below 1e-5): the one token a greedy row can take is the lowest index of its maximum."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0]])
    params = SamplingTensors.build(temperature=[0.0, 1e-6], keys=[0, 0])
    for backend in ("torch", "cpu"):
        mask = get_sampler(backend).kept_mask(logits, params)
        assert mask.tolist() == [[False, True, False, False], [True, False, False, False]]
