"""Bitwise determinism: the same keys give the same tokens on every backend (torch, cpu, Triton interpreted), at
any thread count, and whatever else is in the batch."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from pagoda.pagedkernel.cbuild import cpu_flags, for_march
from pagoda.pagedkernel.sampling import SamplingTensors, cpu_sampling, get_sampler, rng_key, triton_sampling
from pagoda.pagedkernel.sampling.testing import select_rows, tricky_logits
from torch import Tensor


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """torch (and so the C kernel) on n threads for the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _batch(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple[Tensor, SamplingTensors]:
    """Logits of three kinds (LLM-like, tied and -inf, flat) and mixed greedy / sampled / truncated rows."""
    g = torch.Generator().manual_seed(seed)
    llm = torch.randn(rows, vocab, generator=g) * 3.0
    llm[:, :: max(1, vocab // 7)] += 12.0  # a few clear favourites
    tied = tricky_logits(rows, vocab, seed=seed)
    flat = torch.randn(rows, vocab, generator=g) * 0.2
    logits = torch.where((torch.arange(rows) % 3 == 0).unsqueeze(1), llm, tied)
    logits = torch.where((torch.arange(rows) % 3 == 2).unsqueeze(1), flat, logits).to(dtype)
    params = SamplingTensors.build(
        temperature=[[0.0, 1.0, 0.7, 1.5, 1.0][i % 5] for i in range(rows)],
        keys=[rng_key(seed, i % 2, i) for i in range(rows)],
        top_k=[[None, None, 40, 3, 1000][i % 5] for i in range(rows)],
        top_p=[[1.0, 1.0, 0.9, 1.0, 0.5, 0.95][i % 6] for i in range(rows)],
        min_p=[[0.0, 0.0, 0.0, 0.05][i % 4] for i in range(rows)],
    )
    return logits, params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_torch_and_cpu_agree(dtype: torch.dtype) -> None:
    """30 mixed rows of 50,000 tokens: bitwise the same tokens and statuses."""
    logits, params = _batch(30, 50_000, dtype, seed=11)
    expected = get_sampler("torch")(logits, params)
    got = get_sampler("cpu")(logits, params)
    assert torch.equal(got.status, expected.status)
    assert torch.equal(got.token_ids, expected.token_ids)


def test_thread_counts_agree() -> None:
    """1, 2 and 5 threads, for batches that split rows across threads and single rows that split the vocabulary."""
    sampler = get_sampler("cpu")
    for rows in (1, 3, 40):
        logits, params = _batch(rows, 70_000, torch.bfloat16, seed=rows)
        results = []
        for n in (1, 2, 5):
            with _threads(n):
                results.append(sampler(logits, params).token_ids)
        assert all(torch.equal(r, results[0]) for r in results), rows
        assert torch.equal(results[0], get_sampler("torch")(logits, params).token_ids)


def test_a_row_draws_the_same_alone_and_in_a_batch() -> None:
    """A seeded row's token does not depend on the other rows (16 mixed rows, or itself alone)."""
    logits, params = _batch(16, 20_000, torch.float32, seed=5)
    for backend in ("torch", "cpu"):
        batch = get_sampler(backend)(logits, params).token_ids
        for i in range(16):
            alone = select_rows(params, slice(i, i + 1))
            assert int(get_sampler(backend)(logits[i : i + 1], alone).token_ids[0]) == int(batch[i])


def test_triton_agrees_with_torch() -> None:
    """The Triton kernel (interpreted on the CPU, compiled on CUDA): 15 mixed rows, several blocks per row."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits, params = _batch(15, 700, torch.bfloat16, seed=3)
    expected = get_sampler("torch")(logits, params)
    on_device = SamplingTensors(
        temperature=params.temperature.to(device),
        top_k=params.top_k.to(device),
        top_p=params.top_p.to(device),
        min_p=params.min_p.to(device),
        keys=params.keys.to(device),
    )
    args = (
        on_device.inverse_temperature(),
        on_device.top_k,
        on_device.top_p,
        on_device.min_p,
        on_device.keys,
    )
    tokens, status, _ = triton_sampling.run(logits.to(device), *args, with_mask=False, block=256)
    assert torch.equal(status.cpu(), expected.status)
    assert torch.equal(tokens.cpu(), expected.token_ids)


def test_strided_rows() -> None:
    """Logits sliced out of a wider buffer (row stride > vocab) give the tokens of a contiguous copy."""
    logits, params = _batch(6, 3000, torch.float32, seed=8)
    wide = torch.full((6, 3500), float("nan"))
    wide[:, :3000] = logits
    for backend in ("torch", "cpu"):
        sampler = get_sampler(backend)
        assert torch.equal(sampler(wide[:, :3000], params).token_ids, sampler(logits, params).token_ids)


def test_the_build_without_openmp_agrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler without OpenMP gets a single-threaded library: bitwise the same tokens."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_sampling, "OPENMP_FLAGS", ())
    entry = cpu_sampling.load(cpu_sampling.build(torch.bfloat16))
    logits, params = _batch(9, 40_000, torch.bfloat16, seed=9)
    args = (params.inverse_temperature(), params.top_k, params.top_p, params.min_p, params.keys)
    tokens, status, _ = cpu_sampling.run(logits, *args, with_mask=False, entry=entry)
    expected = get_sampler("cpu")(logits, params)
    assert torch.equal(tokens, expected.token_ids) and torch.equal(status, expected.status)


@pytest.mark.parametrize("march", ["x86-64-v4", "x86-64-v3", "x86-64"])
def test_other_vector_widths_agree(march: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel built for AVX-512 (sixteen lanes, compressed gathers), AVX2 (eight lanes, permuted gathers) and
    plain x86-64 (generic vectors, scalar masks) draws what the native build draws. Every target compiles here
    (a compile error fails); one this CPU cannot run is not run."""
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 target flags")
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    flags = for_march(cpu_sampling.CFLAGS, march)
    library = cpu_sampling.build(torch.float32, flags=flags)
    if march == "x86-64-v4" and "avx512bw" not in cpu_flags():
        pytest.skip("this CPU cannot run -march=x86-64-v4 (built only)")
    entry = cpu_sampling.load(library)
    logits, params = _batch(12, 30_000, torch.float32, seed=12)
    args = (params.inverse_temperature(), params.top_k, params.top_p, params.min_p, params.keys)
    tokens, status, mask = cpu_sampling.run(logits, *args, with_mask=True, entry=entry)
    expected = get_sampler("cpu")(logits, params)
    assert torch.equal(tokens, expected.token_ids) and torch.equal(status, expected.status)
    assert mask is not None and torch.equal(mask, get_sampler("cpu").kept_mask(logits, params))
