"""int8 KV caches in the Triton kernels (under TRITON_INTERPRET=1 on the CPU, see conftest.py; compiled on CUDA when
present), against the torch reference over the same int8 cache and scales.

Caches are written by the torch reference in rounds (`testing.quantize_case`: prompt chunks, single tokens, a
padding row each round), unwritten slots hold random bytes, every scale starts NaN and outputs are preallocated
full of NaN; contexts cross block boundaries and the decode runs in one partition and in several.
"""

from __future__ import annotations

import pytest
import torch
from pagoda.pagedkernel import triton_backend
from pagoda.pagedkernel.testing import AttentionConfig as Case
from pagoda.pagedkernel.testing import PagedCase, QuantizedCase, make_case, quantize_case, relative_error
from pagoda.pagedkernel.torch_backend import TorchBackend
from pagoda.pagedkernel.triton_backend import TritonBackend
from torch import Tensor

TORCH, TRITON = TorchBackend(), TritonBackend()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [
    Case(64, 8, 1, None, None),
    Case(64, 16, 4, 32, None),
    Case(32, 16, 2, None, 30.0),
]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _quantized(case: Case, dtype: torch.dtype) -> QuantizedCase:
    bs = case.block_size
    c = make_case(
        [(1, 1), (bs, bs), (bs + 1, 3), (3 * bs + 5, 2 * bs), (70, 1)],
        num_heads=2 * case.group,
        num_kv_heads=2,
        head_dim=case.head_dim,
        block_size=bs,
        dtype=dtype,
        poison_unused=True,
    )

    def write(
        key: Tensor, value: Tensor, k: Tensor, v: Tensor, slots: Tensor, k_scale: Tensor, v_scale: Tensor
    ) -> None:
        TORCH.reshape_and_cache(key, value, k, v, slots, k_scale=k_scale, v_scale=v_scale)

    qc = quantize_case(c, write)
    if DEVICE == "cpu":
        return qc
    q, k, v, tables, starts, lens = (
        t.to(DEVICE) for t in (c.q, c.k_cache, c.v_cache, c.block_tables, c.query_start_loc, c.context_lens)
    )
    moved = PagedCase(q, k, v, tables, starts, lens, c.scale)  # the same case on the GPU
    return QuantizedCase(moved, *(t.to(DEVICE) for t in (qc.k_cache, qc.v_cache, qc.k_scale, qc.v_scale)))


def _forbid_the_torch_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on the torch backend's attention raises: the Triton ops must not hand int8 caches to it."""

    def refuse(*args: object, **kwargs: object) -> Tensor:
        raise AssertionError("the Triton backend fell back to the torch reference")

    monkeypatch.setattr(TorchBackend, "paged_prefill_attention", refuse)
    monkeypatch.setattr(TorchBackend, "paged_decode_attention", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_int8_prefill_and_decode_match_the_torch_reference(
    case: Case, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill and decode (one partition and partitions of 16 keys) read int8 rows and both scales natively."""
    qc = _quantized(case, dtype)
    c = qc.case
    window, softcap = case.sliding_window, case.logit_softcap
    args = (c.q, qc.k_cache, qc.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    ref = TORCH.paged_prefill_attention(
        *args, sliding_window=window, logit_softcap=softcap, k_scale=qc.k_scale, v_scale=qc.v_scale
    )
    last = c.query_start_loc[1:].long() - 1
    q = c.q[last].contiguous()
    decode = (q, qc.k_cache, qc.v_cache, c.block_tables, c.context_lens, c.scale)
    ref_decode = TORCH.paged_decode_attention(
        *decode, sliding_window=window, logit_softcap=softcap, k_scale=qc.k_scale, v_scale=qc.v_scale
    )
    _forbid_the_torch_reference(monkeypatch)
    out = torch.full_like(c.q, float("nan"))
    got = TRITON.paged_prefill_attention(
        *args, sliding_window=window, logit_softcap=softcap, out=out, k_scale=qc.k_scale, v_scale=qc.v_scale
    )
    assert got is out and out.dtype == dtype
    assert relative_error(out, ref) < TOLERANCE[dtype]
    for partition_size in (512, 16):
        out = torch.full_like(q, float("nan"))
        triton_backend.decode_with_partitions(
            *decode,
            sliding_window=window,
            logit_softcap=softcap,
            out=out,
            partition_size=partition_size,
            k_scale=qc.k_scale,
            v_scale=qc.v_scale,
        )
        assert relative_error(out, ref_decode) < TOLERANCE[dtype], partition_size


def test_int8_attention_reads_the_scales() -> None:
    """Doubling every value scale doubles the output; scaling a key channel changes it (the scales are read,
    not assumed 1)."""
    qc = _quantized(CASES[0], torch.float32)
    c = qc.case
    args = (c.q, qc.k_cache, qc.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    base = TRITON.paged_prefill_attention(*args, k_scale=qc.k_scale, v_scale=qc.v_scale)
    doubled = TRITON.paged_prefill_attention(*args, k_scale=qc.k_scale, v_scale=2 * qc.v_scale)
    assert relative_error(doubled, 2 * base) < 1e-5
    k_scale = qc.k_scale.clone()
    k_scale[..., 0] *= 8
    other = TRITON.paged_prefill_attention(*args, k_scale=k_scale, v_scale=qc.v_scale)
    ref = TORCH.paged_prefill_attention(*args, k_scale=k_scale, v_scale=qc.v_scale)
    assert relative_error(other, base) > 1e-3 and relative_error(other, ref) < 1e-4
