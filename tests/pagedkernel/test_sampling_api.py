"""The sampling op's interface: per-row errors, logprobs, parameter checks and backend selection."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from pagoda.pagedkernel.backend import BackendUnavailableError
from pagoda.pagedkernel.sampling import (
    SampleStatus,
    SamplingError,
    SamplingTensors,
    cpu_sampling,
    get_sampler,
    rng_key,
)
from pagoda.pagedkernel.sampling.params import GREEDY_TEMPERATURE
from pagoda.pagedkernel.sampling.testing import select_rows

BACKENDS = ["torch", "cpu", "triton"]


def _params(
    rows: int, temperature: float = 1.0, *, top_k: int | None = None, top_p: float = 1.0
) -> SamplingTensors:
    """Every row alike, each with its own key."""
    return SamplingTensors.build(
        temperature=[temperature] * rows,
        keys=[rng_key(1, 0, i) for i in range(rows)],
        top_k=[top_k] * rows,
        top_p=[top_p] * rows,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_bad_row_fails_alone(backend: str, temperature: float) -> None:
    """NaN, +inf and all -inf rows get their status and token 0; the other rows draw what they draw alone."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 2
    logits[1, 17] = float("nan")
    logits[3, 200] = float("inf")
    logits[4] = float("-inf")
    params = _params(6, temperature, top_p=0.9)
    out = get_sampler(backend)(logits, params)
    assert out.failed_rows() == {
        1: SampleStatus.NONFINITE,
        3: SampleStatus.NONFINITE,
        4: SampleStatus.NO_TOKEN,
    }
    assert out.token_ids[[1, 3, 4]].tolist() == [0, 0, 0]
    clean = get_sampler(backend)(logits[[0, 2, 5]], select_rows(params, [0, 2, 5]))
    assert out.token_ids[[0, 2, 5]].tolist() == clean.token_ids.tolist()
    with pytest.raises(SamplingError, match=r"row 1: NONFINITE, row 3: NONFINITE, row 4: NO_TOKEN") as info:
        out.raise_for_status()
    assert set(info.value.rows) == {1, 3, 4}
    clean.raise_for_status()


def test_overflowing_temperature_is_nonfinite() -> None:
    """Finite logits that overflow float32 after 1/T are reported, not sampled as +inf."""
    logits = torch.tensor([[3e38, 1.0, 0.0]])
    for backend in ("torch", "cpu"):
        out = get_sampler(backend)(logits, _params(1, 0.5))
        assert out.failed_rows() == {0: SampleStatus.NONFINITE}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_logprobs_are_of_the_raw_distribution(backend: str) -> None:
    """Only asking rows get logprobs: log_softmax of the raw logits, whatever the temperature and truncation."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=g).to(torch.bfloat16)
    params = _params(4, 0.5, top_k=3)
    out = get_sampler(backend)(logits, params, num_logprobs=[None, 0, 5, 2])
    assert out.logprobs is not None
    lp = out.logprobs
    assert lp.rows.tolist() == [1, 2, 3] and lp.top == (0, 5, 2)
    reference = torch.log_softmax(logits.float(), dim=-1)
    for j, i in enumerate(lp.rows.tolist()):
        token = int(out.token_ids[i])
        assert float(lp.sampled[j]) == pytest.approx(float(reference[i, token]), abs=1e-6)
        assert int(lp.rank[j]) == int((reference[i] > reference[i, token]).sum()) + 1
        k = lp.top[j]
        assert lp.top_token_ids[j, :k].tolist() == reference[i].topk(k).indices.tolist()
        assert torch.allclose(lp.top_logprobs[j, :k], reference[i].topk(k).values)
    assert get_sampler(backend)(logits, params, num_logprobs=[None] * 4).logprobs is None
    assert get_sampler(backend)(logits, params).logprobs is None


def test_greedy_takes_the_lowest_index_of_the_maximum() -> None:
    """Ties at the maximum go to the lowest index, also in bfloat16 and past the first vector of logits."""
    logits = torch.zeros(3, 100)
    logits[0, [5, 9]] = 2.0
    logits[1, [40, 99]] = 7.0
    logits[2, :] = -1.0
    for backend in BACKENDS:
        for dtype in (torch.float32, torch.bfloat16):
            out = get_sampler(backend)(logits.to(dtype), _params(3, 0.0))
            assert out.token_ids.tolist() == [5, 40, 0], (backend, dtype)


def test_parameters_are_checked() -> None:
    """Out-of-range values name the row; shapes and dtypes that do not fit are refused."""
    with pytest.raises(ValueError, match="row 1: temperature"):
        SamplingTensors.build(temperature=[1.0, -1.0], keys=[0, 0])
    with pytest.raises(ValueError, match="row 0: top_p"):
        SamplingTensors.build(temperature=[1.0], keys=[0], top_p=[0.0])
    with pytest.raises(ValueError, match="row 0: min_p"):
        SamplingTensors.build(temperature=[1.0], keys=[0], min_p=[1.5])
    with pytest.raises(ValueError, match="row 0: top_k"):
        SamplingTensors.build(temperature=[1.0], keys=[0], top_k=[-1])
    with pytest.raises(ValueError, match="one value per row"):
        SamplingTensors.build(temperature=[1.0, 1.0], keys=[0])
    sampler = get_sampler("cpu")
    with pytest.raises(ValueError, match=r"params.temperature must have shape \(2,\)"):
        sampler(torch.zeros(2, 10), _params(3))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        sampler(torch.zeros(1, 10, dtype=torch.float64), _params(1))
    with pytest.raises(ValueError, match=r"\[rows, vocab\]"):
        sampler(torch.zeros(10), _params(1))


def test_empty_batch() -> None:
    """Zero rows: empty outputs."""
    for backend in BACKENDS:
        out = get_sampler(backend)(torch.zeros(0, 10), _params(0))
        assert out.token_ids.shape == (0,) and out.status.shape == (0,)


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto is cpu on the CPU; unknown names and impossible devices are refused with what to use instead."""
    assert get_sampler("auto", "cpu").name == "cpu"
    assert get_sampler("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="unknown sampler backend"):
        get_sampler("fast")
    with pytest.raises(BackendUnavailableError, match="runs on the CPU"):
        get_sampler("cpu", "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        get_sampler("triton", "cpu")


def test_missing_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No C compiler: 'cpu' is a clear error, and 'auto' falls back to torch with a warning saying why."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(BackendUnavailableError, match="found no C compiler"):
        get_sampler("cpu")
    with caplog.at_level(logging.WARNING):
        assert get_sampler("auto", "cpu").name == "torch"
    assert "sampling runs through torch" in caplog.text
    assert not list(tmp_path.iterdir())
    assert cpu_sampling.available()  # the process's own library was loaded before and stays usable


def test_inverse_temperature_of_few_rows_is_the_tensor_ops() -> None:
    """A few rows' 1 / T (read as Python numbers) has the bits of the tensor ops many rows take: the greedy bound
    as float32 compares it (the float32 of 1e-5 itself is sampled, the float just below greedy), the quotient
    rounded once to float32, 0 for greedy rows, NaN and infinity through."""
    bound = torch.tensor(GREEDY_TEMPERATURE, dtype=torch.float32)
    edges = [bound.item(), torch.nextafter(bound, torch.tensor(0.0)).item(), 0.0, float("inf"), float("nan")]
    values = edges + torch.rand(40, generator=torch.Generator().manual_seed(3)).mul(3).tolist()
    for start in range(0, len(values), 5):
        t = torch.tensor(values[start : start + 5], dtype=torch.float32)
        zeros = torch.zeros(5, dtype=torch.int64)
        params = SamplingTensors(t, zeros, torch.ones(5), torch.zeros(5), zeros)
        many = SamplingTensors.build(temperature=[1.0] * 9, keys=[0] * 9)  # past the few rows: the tensor ops
        wide = replace(many, temperature=torch.cat([t, many.temperature[5:]]))
        assert torch.equal(params.inverse_temperature().isnan(), t.isnan())
        got, want = params.inverse_temperature(), wide.inverse_temperature()[:5]
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), (t, got, want)
    inverse = SamplingTensors.build(temperature=[edges[0], edges[1]], keys=[0, 0]).inverse_temperature()
    assert inverse[0] > 0.0 and inverse[1] == 0.0
