"""fp8 KV caches (e4m3fn, e5m2): the torch reference, and the Triton kernels against it.

On the CPU the Triton kernels run under TRITON_INTERPRET=1 (conftest.py) on small shapes; with CUDA they compile
and run (the `gpu` test at the end). Writes saturate to the format's finite range (e4m3fn has no infinity);
attention widens the rows to q's dtype. Outputs are preallocated full of NaN and contexts cross block boundaries.
"""

from __future__ import annotations

import pytest
import torch
from pagoda.pagedkernel import kv_quant
from pagoda.pagedkernel.testing import PagedCase, make_case, reference_attention, relative_error
from pagoda.pagedkernel.torch_backend import TorchBackend
from pagoda.pagedkernel.triton_backend import TritonBackend
from torch import Tensor

TORCH, TRITON = TorchBackend(), TritonBackend()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# fp8's rounding of K/V (3 or 2 mantissa bits) against attention over the unrounded values.
QUANT_TOLERANCE = {torch.float8_e4m3fn: 0.06, torch.float8_e5m2: 0.12}


def _case(dtype: torch.dtype, block_size: int = 8) -> PagedCase:
    seqs = [(1, 1), (block_size, block_size), (block_size + 1, 3), (45, 6)]
    return make_case(
        seqs, num_heads=4, num_kv_heads=2, head_dim=32, block_size=block_size, dtype=dtype, device=DEVICE
    )


def _fp8_cache(
    c: PagedCase, fp8: torch.dtype, backend: TorchBackend | TritonBackend
) -> tuple[Tensor, Tensor]:
    """The case's K/V written into fp8 caches (slot by slot through `backend`), a padding row included."""
    num_blocks, block_size, heads, dim = c.k_cache.shape
    k = torch.zeros(c.k_cache.shape, dtype=fp8, device=DEVICE)
    v = torch.zeros(c.k_cache.shape, dtype=fp8, device=DEVICE)
    slots = torch.arange(num_blocks * block_size, device=DEVICE)
    pad = torch.tensor([-1], device=DEVICE)
    key = torch.cat([c.k_cache.view(-1, heads, dim), c.k_cache.new_zeros(1, heads, dim)])
    value = torch.cat([c.v_cache.view(-1, heads, dim), c.v_cache.new_zeros(1, heads, dim)])
    backend.reshape_and_cache(key, value, k, v, torch.cat([slots, pad]))
    return k, v


def test_writes_saturate_instead_of_becoming_nan() -> None:
    """Values beyond e4m3fn's 448 store as +-448, not NaN; e5m2 keeps its 57344 limit."""
    for fp8 in FP8:
        limit = torch.finfo(fp8).max
        x = torch.tensor([[[2.0 * limit, -2.0 * limit, 1.0, 0.0]]])
        cache = torch.zeros(1, 1, 1, 4, dtype=fp8)
        TORCH.reshape_and_cache(x, x, cache, cache.clone(), torch.tensor([0]))
        assert cache.float().flatten().tolist() == [limit, -limit, 1.0, 0.0]
        assert kv_quant.storage_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_triton_write_equals_torch_bitwise(fp8: torch.dtype, dtype: torch.dtype) -> None:
    """Triton's fp8 cache write gives the torch reference's bytes (its kernel rounds to nearest even itself: the
    interpreter's own fp8 cast loses carries, e.g. -0.4927 became -0.25)."""
    c = _case(dtype)
    ours, ref = _fp8_cache(c, fp8, TRITON), _fp8_cache(c, fp8, TORCH)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    tiny = torch.tensor([[[1e-3, -3e-5, 0.0, 5e4]]], device=DEVICE, dtype=dtype)  # subnormals and saturation
    mine, theirs = (torch.zeros(1, 1, 1, 4, dtype=fp8, device=DEVICE) for _ in range(2))
    TRITON.reshape_and_cache(tiny, tiny, mine, mine.clone(), torch.tensor([0], device=DEVICE))
    TORCH.reshape_and_cache(tiny, tiny, theirs, theirs.clone(), torch.tensor([0], device=DEVICE))
    assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_fp8_attention_triton_matches_torch(fp8: torch.dtype, dtype: torch.dtype, window: int | None) -> None:
    """Prefill and decode over an fp8 cache: Triton against the torch reference over the same cache, and both
    within fp8's rounding of the attention over the unrounded K/V."""
    c = _case(dtype)
    k, v = _fp8_cache(c, fp8, TORCH)
    exact = reference_attention(c, sliding_window=window)
    args = (c.q, k, v, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    out = torch.full_like(c.q, float("nan"))
    assert TRITON.paged_prefill_attention(*args, sliding_window=window, out=out) is out
    ref = TORCH.paged_prefill_attention(*args, sliding_window=window)
    assert relative_error(out, ref) < (1e-3 if dtype == torch.float32 else 2e-2)
    assert relative_error(ref, exact) < QUANT_TOLERANCE[fp8]
    last = c.query_start_loc[1:].long() - 1
    q = c.q[last].contiguous()
    decode = torch.full_like(q, float("nan"))
    TRITON.paged_decode_attention(
        q, k, v, c.block_tables, c.context_lens, c.scale, sliding_window=window, out=decode
    )
    assert relative_error(decode, ref[last]) < (1e-3 if dtype == torch.float32 else 2e-2)


def test_int8_on_triton_writes_as_the_torch_reference_and_attends_natively() -> None:
    """Triton's int8 writes are the torch reference's (the same bytes and scales); its attention reads the int8
    cache itself (test_kv_int8_triton.py) and agrees with the reference within float32 rounding."""
    c = _case(torch.float32)
    num_blocks, block_size, heads, head_dim = c.k_cache.shape
    caches = [torch.zeros(c.k_cache.shape, dtype=torch.int8, device=DEVICE) for _ in range(4)]
    k_scales = [
        torch.ones(num_blocks, heads, head_dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)
    ]
    v_scales = [torch.ones(num_blocks, block_size, heads, device=DEVICE) for _ in range(2)]
    slots = torch.arange(num_blocks * block_size, device=DEVICE)
    key, value = c.k_cache.view(-1, *c.k_cache.shape[2:]), c.v_cache.view(-1, *c.v_cache.shape[2:])
    TRITON.reshape_and_cache(
        key, value, caches[0], caches[1], slots, k_scale=k_scales[0], v_scale=v_scales[0]
    )
    TORCH.reshape_and_cache(key, value, caches[2], caches[3], slots, k_scale=k_scales[1], v_scale=v_scales[1])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(k_scales[0], k_scales[1]) and torch.equal(v_scales[0], v_scales[1])
    args = (c.q, caches[0], caches[1], c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    ours = TRITON.paged_prefill_attention(*args, k_scale=k_scales[0], v_scale=v_scales[0])
    ref = TORCH.paged_prefill_attention(*args, k_scale=k_scales[0], v_scale=v_scales[0])
    assert relative_error(ours, ref) < 1e-4
