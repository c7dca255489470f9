"""The Triton backend against the torch backend: under TRITON_INTERPRET=1 on the CPU (see conftest.py), compiled on
CUDA when present.

The attention cases are a covering set rather than the full cross product, so the file stays within a couple of
minutes in the interpreter: every head_dim in {64, 128, 256}, block size in {8, 16, 32} and GQA ratio in {1, 4}
appears, with the sliding window and softcap each on and off for every head_dim. Each batch mixes contexts of 1,
block_size, block_size + 1 and ~300 tokens. Outputs are preallocated full of NaN, so every element must be written.
"""

from __future__ import annotations

import pytest
import torch
from pagoda.pagedkernel import KernelBackend, get_backend, triton_backend
from pagoda.pagedkernel.testing import AttentionConfig as Case
from pagoda.pagedkernel.testing import make_case, reference_attention, relative_error
from pagoda.pagedkernel.torch_backend import TorchBackend
from pagoda.pagedkernel.triton_backend import TritonBackend

TORCH, TRITON = TorchBackend(), TritonBackend()
# mypy proves that the class satisfies the shared interface.
_OPS: KernelBackend = TRITON

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


CASES = [
    Case(64, 8, 1, None, None),
    Case(64, 16, 4, 32, None),
    Case(128, 32, 1, None, 30.0),
    Case(128, 8, 4, 100, 50.0),
    Case(256, 16, 1, 40, None),
    Case(256, 32, 4, None, 20.0),
]


def _contexts(block_size: int) -> list[int]:
    return [1, block_size, block_size + 1, 300]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_matches_torch(case: Case) -> None:
    """Fresh prompts, a prefix-cache hit and a chunk of a long context, in one varlen batch."""
    bs = case.block_size
    seqs = [(1, 1), (bs, bs), (bs + 1, 3), (300, 24)]
    c = make_case(
        seqs, num_heads=2 * case.group, num_kv_heads=2, head_dim=case.head_dim, block_size=bs, device=DEVICE
    )
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    window, softcap = case.sliding_window, case.logit_softcap
    out = torch.full_like(c.q, float("nan"))
    result = TRITON.paged_prefill_attention(*args, sliding_window=window, logit_softcap=softcap, out=out)
    assert result is out
    ref = TORCH.paged_prefill_attention(*args, sliding_window=window, logit_softcap=softcap)
    assert relative_error(out, ref) < 1e-3


@pytest.mark.parametrize("partition_size", [512, 64])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_matches_torch(case: Case, partition_size: int) -> None:
    """Decode, in one partition and split into partitions of 64 keys reduced by the second kernel."""
    seqs = [(n, 1) for n in _contexts(case.block_size)]
    c = make_case(
        seqs,
        num_heads=2 * case.group,
        num_kv_heads=2,
        head_dim=case.head_dim,
        block_size=case.block_size,
        seed=1,
        device=DEVICE,
    )
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.context_lens, c.scale)
    out = torch.full_like(c.q, float("nan"))
    triton_backend.decode_with_partitions(
        *args,
        sliding_window=case.sliding_window,
        logit_softcap=case.logit_softcap,
        out=out,
        partition_size=partition_size,
    )
    ref = TORCH.paged_decode_attention(
        *args, sliding_window=case.sliding_window, logit_softcap=case.logit_softcap
    )
    assert relative_error(out, ref) < 1e-3


def test_decode_default_partitions_long_context() -> None:
    """The public op splits a context longer than one partition (512 keys)."""
    c = make_case([(700, 1), (5, 1)], num_heads=4, num_kv_heads=1, head_dim=16, block_size=32, device=DEVICE)
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.context_lens, c.scale)
    out = torch.full_like(c.q, float("nan"))
    TRITON.paged_decode_attention(*args, out=out)
    assert relative_error(out, TORCH.paged_decode_attention(*args)) < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype: torch.dtype) -> None:
    """bfloat16/float16 caches: output in the same dtype, within half-precision rounding of the torch backend."""
    c = make_case(
        [(1, 1), (16, 16), (17, 3), (90, 1)],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        device=DEVICE,
    )
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    out = TRITON.paged_prefill_attention(*args)
    assert out.dtype == dtype
    assert relative_error(out, TORCH.paged_prefill_attention(*args)) < 1e-2


def test_unwritten_slots_never_reach_the_output() -> None:
    """NaN in every cache slot outside the contexts is masked out by both kernels."""
    c = make_case(
        [(20, 20), (9, 3), (33, 1)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=16,
        poison_unused=True,
        device=DEVICE,
    )
    prefill = (c.q, c.k_cache, c.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    ref = reference_attention(c)
    assert relative_error(TRITON.paged_prefill_attention(*prefill), ref) < 1e-3
    decode = (
        c.q[c.query_start_loc[1:].long() - 1],
        c.k_cache,
        c.v_cache,
        c.block_tables,
        c.context_lens,
        c.scale,
    )
    ref_decode = ref[c.query_start_loc[1:].long() - 1]
    for partition_size in (512, 16):
        out = triton_backend.decode_with_partitions(
            *decode, sliding_window=None, logit_softcap=None, out=None, partition_size=partition_size
        )
        assert relative_error(out, ref_decode) < 1e-3


def test_reshape_and_cache_matches_torch() -> None:
    """Strided key/value (slices of a fused projection) land in the same slots; negative slots write nothing."""
    qkv = torch.randn(6, 3, 4, 32, device=DEVICE)  # [num_tokens, (q, k, v), num_kv_heads, head_dim]
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([3, -1, 17, 0, 31, -2], device=DEVICE)
    caches = [torch.zeros(4, 8, 4, 32, device=DEVICE) for _ in range(4)]
    TRITON.reshape_and_cache(key, value, caches[0], caches[1], slots)
    TORCH.reshape_and_cache(key, value, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0)
    assert int((caches[0] != 0).any(dim=(2, 3)).sum()) == 4


def test_copy_blocks_matches_torch() -> None:
    """All layers' K and V copied in one launch, exactly as the torch backend does."""
    caches = [torch.randn(7, 8, 2, 16, dtype=torch.float16, device=DEVICE) for _ in range(6)]
    expected = [c.clone() for c in caches]
    pairs = torch.tensor([[0, 4], [6, 1], [2, 3]])
    TRITON.copy_blocks(caches[:3], caches[3:], pairs)
    TORCH.copy_blocks(expected[:3], expected[3:], pairs)
    for got, want in zip(caches, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_swap_blocks_same_device_uses_kernel() -> None:
    """Swapping between two caches on one device copies the requested blocks and nothing else."""
    src = torch.randn(5, 8, 2, 16, device=DEVICE)
    dst = torch.zeros(3, 8, 2, 16, device=DEVICE)
    TRITON.swap_blocks(src, dst, torch.tensor([[4, 0], [1, 2]]))
    torch.testing.assert_close(dst[0], src[4], rtol=0, atol=0)
    torch.testing.assert_close(dst[2], src[1], rtol=0, atol=0)
    assert not dst[1].any()


def test_launcher_rejects_non_contiguous_cache() -> None:
    """Launchers assert the layout the kernels index with, instead of reading the wrong memory."""
    cache = torch.zeros(4, 2, 8, 16, device=DEVICE).transpose(1, 2)
    key = torch.zeros(1, 2, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="contiguous"):
        TRITON.reshape_and_cache(key, key, cache, cache, torch.tensor([0], device=DEVICE))


def test_registry_gives_triton() -> None:
    """get_backend('triton') works here: on CUDA, or on the CPU under the interpreter."""
    assert get_backend("triton", DEVICE).name == "triton"
    assert type(get_backend("triton", DEVICE)) is TritonBackend
