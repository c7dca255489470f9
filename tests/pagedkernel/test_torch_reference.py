"""The torch backend against dense float64 attention, and its cache ops."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagoda.pagedkernel import KernelBackend, allocate_host_cache, torch_backend
from pagoda.pagedkernel.testing import PagedCase, make_case, reference_attention, relative_error
from pagoda.pagedkernel.torch_backend import TorchBackend
from torch import Tensor

TORCH = TorchBackend()
# mypy proves that the class satisfies the shared interface.
_OPS: KernelBackend = TORCH


def decode(case: PagedCase, **options: Any) -> Tensor:
    """The torch backend's decode attention over a case's own tensors."""
    return TORCH.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale, **options
    )


def prefill(case: PagedCase, **options: Any) -> Tensor:
    """The torch backend's varlen prefill attention over a case's own tensors."""
    return TORCH.paged_prefill_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_start_loc,
        case.context_lens,
        case.scale,
        **options,
    )


PREFILL_SEQS = [
    (1, 1),
    (17, 17),
    (40, 9),
    (33, 1),
    (64, 30),
    (5, 2),
]  # (context_len, q_len): new, chunked, decode


@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("logit_softcap", [None, 5.0])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (4, 1)])
def test_prefill_matches_dense(
    sliding_window: int | None, logit_softcap: float | None, num_heads: int, num_kv_heads: int
) -> None:
    """Varlen prefill (fresh prompts, chunked prefill, prefix hits, decodes) equals dense causal attention."""
    case = make_case(PREFILL_SEQS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16, block_size=8)
    out = torch.full_like(case.q, float("nan"))
    result = prefill(
        case,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        out=out,
    )
    assert result is out
    ref = reference_attention(case, sliding_window=sliding_window, logit_softcap=logit_softcap)
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("sliding_window", [None, 1, 20])
@pytest.mark.parametrize("logit_softcap", [None, 2.0])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2)])
def test_decode_matches_dense(
    sliding_window: int | None, logit_softcap: float | None, num_heads: int, num_kv_heads: int
) -> None:
    """Decode (one query at position context_len - 1) equals dense attention, lengths 1 to several blocks."""
    seqs = [(n, 1) for n in (1, 8, 9, 50, 3)]
    case = make_case(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32, block_size=8, seed=1)
    out = decode(
        case,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )
    ref = reference_attention(case, sliding_window=sliding_window, logit_softcap=logit_softcap)
    assert out.dtype == case.q.dtype
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes(dtype: torch.dtype) -> None:
    """bfloat16/float16 inputs give outputs of the same dtype, accurate to the input rounding."""
    case = make_case(PREFILL_SEQS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, dtype=dtype)
    out = prefill(
        case,
    )
    assert out.dtype == dtype
    assert relative_error(out, reference_attention(case)) < 1e-2


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_bfloat16_decode_matches_dense_with_poisoned_slots(sliding_window: int | None) -> None:
    """bfloat16 decode (two matmuls around a float32 softmax) stays within bfloat16 rounding of dense attention,
    with NaN in every slot outside the contexts and lengths that end mid-block and on a block boundary."""
    seqs = [(n, 1) for n in (1, 8, 9, 50, 3)]
    case = make_case(
        seqs,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        block_size=8,
        seed=2,
        dtype=torch.bfloat16,
        poison_unused=True,
    )
    out = torch.full_like(case.q, float("nan"))
    decode(
        case,
        sliding_window=sliding_window,
        out=out,
    )
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert relative_error(out, reference_attention(case, sliding_window=sliding_window)) < 1e-2


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_unwritten_slots_never_reach_the_output(sliding_window: int | None) -> None:
    """NaN in every cache slot outside the contexts (tails of last blocks, spare blocks) changes nothing."""
    seqs = [(13, 13), (9, 2), (21, 1), (3, 3)]
    case = make_case(seqs, num_heads=4, num_kv_heads=2, head_dim=8, block_size=8, poison_unused=True)
    assert case.k_cache.isnan().any()
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc, case.context_lens)
    for softcap in (None, 3.0):
        out = TORCH.paged_prefill_attention(
            *args, case.scale, sliding_window=sliding_window, logit_softcap=softcap
        )
        ref = reference_attention(case, sliding_window=sliding_window, logit_softcap=softcap)
        assert relative_error(out, ref) < 1e-5


def test_prefill_of_decodes_equals_decode() -> None:
    """Decode is prefill with q_len = 1."""
    seqs = [(n, 1) for n in (4, 19, 1)]
    case = make_case(seqs, num_heads=4, num_kv_heads=1, head_dim=16, block_size=4, seed=3)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables)
    decode = TORCH.paged_decode_attention(*args, case.context_lens, case.scale)
    prefill = TORCH.paged_prefill_attention(*args, case.query_start_loc, case.context_lens, case.scale)
    torch.testing.assert_close(decode, prefill)


def test_uneven_prefill_batches() -> None:
    """A long prompt next to short chunks and decodes (split into several padded groups) is still exact."""
    seqs = [(200, 200), (3, 1), (90, 2), (120, 100), (10, 10), (7, 1)]
    case = make_case(seqs, num_heads=2, num_kv_heads=1, head_dim=8, block_size=16, seed=4)
    out = prefill(
        case,
    )
    assert relative_error(out, reference_attention(case)) < 1e-5


def test_plan_groups_by_length_and_size() -> None:
    """Decodes of similar lengths share a group; far-apart lengths, prompt kinds or big K/V split; q_len 0 skipped."""
    groups = torch_backend.plan_groups(
        [1, 300, 1, 290, 5, 0, 1], [10, 300, 11, 290, 5, 4, 400], bytes_per_key=8
    )
    assert sorted(map(sorted, groups)) == [[0, 2], [1, 3], [4], [6]]
    # Same shapes: whole prompts batch together, a chunk with a cached prefix (q_len < keys) does not join them.
    groups = torch_backend.plan_groups([64, 64, 64, 64], [64, 64, 64, 100], bytes_per_key=8)
    assert sorted(map(sorted, groups)) == [[0, 1, 2], [3]]
    budget_keys = torch_backend.GROUP_BYTES // 1000
    groups = torch_backend.plan_groups([1] * 5, [budget_keys // 2] * 5, bytes_per_key=1000)
    assert [len(g) for g in groups] == [2, 2, 1]
    assert torch_backend.plan_groups([1], [10 * budget_keys], bytes_per_key=1000) == [[0]]


def test_large_decode_batch_split_into_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose K/V exceed one group's budget gives the same result as the dense reference."""
    monkeypatch.setattr(torch_backend, "GROUP_BYTES", 4 << 20)
    seqs = [(n, 1) for n in (700, 30, 900, 1, 650, 800)]
    case = make_case(seqs, num_heads=4, num_kv_heads=2, head_dim=256, block_size=16, seed=5)
    assert len(torch_backend.plan_groups([1] * 6, [n for n, _ in seqs], 2 * 4 * 2 * 256, 4 << 20)) > 1
    out = decode(
        case,
    )
    assert relative_error(out, reference_attention(case)) < 1e-5


def test_reshape_and_cache_skips_negative_slots() -> None:
    """Each token lands in its slot; padding (negative) slots write nothing."""
    k_cache = torch.zeros(4, 4, 2, 3)
    v_cache = torch.zeros(4, 4, 2, 3)
    key = torch.randn(5, 2, 3)
    value = torch.randn(5, 2, 3)
    slots = torch.tensor([5, -1, 0, 15, -7])
    TORCH.reshape_and_cache(key, value, k_cache, v_cache, slots)
    for t, slot in [(0, 5), (2, 0), (3, 15)]:
        torch.testing.assert_close(k_cache[slot // 4, slot % 4], key[t])
        torch.testing.assert_close(v_cache[slot // 4, slot % 4], value[t])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 3
    assert int((v_cache != 0).any(dim=(2, 3)).sum()) == 3


def test_reshape_and_cache_rejects_non_contiguous_cache() -> None:
    """Writing into a strided cache view would silently write into a copy, so it fails instead."""
    cache = torch.zeros(4, 2, 4, 3).transpose(1, 2)
    with pytest.raises(RuntimeError):
        TORCH.reshape_and_cache(torch.ones(1, 2, 3), torch.ones(1, 2, 3), cache, cache, torch.tensor([0]))


def test_copy_blocks_all_layers() -> None:
    """Every layer's K and V get block src copied into dst; other blocks untouched."""
    k_caches = [torch.randn(6, 4, 2, 3) for _ in range(3)]
    v_caches = [torch.randn(6, 4, 2, 3) for _ in range(3)]
    before = [c.clone() for c in [*k_caches, *v_caches]]
    pairs = torch.tensor([[0, 3], [2, 5]])
    TORCH.copy_blocks(k_caches, v_caches, pairs)
    for cache, old in zip([*k_caches, *v_caches], before, strict=True):
        expected = old.clone()
        expected[3], expected[5] = old[0], old[2]
        torch.testing.assert_close(cache, expected)
    TORCH.copy_blocks(k_caches, v_caches, torch.empty(0, 2, dtype=torch.long))


def test_swap_blocks_roundtrip_host_cache() -> None:
    """Blocks swapped out to a host cache and back come back identical, in the requested slots."""
    device_cache = torch.randn(5, 4, 2, 8, dtype=torch.bfloat16)
    host = allocate_host_cache(3, 4, 2, 8, torch.bfloat16)
    assert host.shape == (3, 4, 2, 8) and host.device.type == "cpu"
    TORCH.swap_blocks(device_cache, host, torch.tensor([[4, 0], [1, 2]]))
    torch.testing.assert_close(host[0], device_cache[4])
    torch.testing.assert_close(host[2], device_cache[1])
    restored = torch.zeros_like(device_cache)
    TORCH.swap_blocks(host, restored, torch.tensor([[0, 1], [2, 3]]))
    torch.testing.assert_close(restored[1], device_cache[4])
    torch.testing.assert_close(restored[3], device_cache[1])
    assert not restored[0].any() and not restored[2].any() and not restored[4].any()


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(
        st.integers(1, 40).flatmap(lambda ctx: st.tuples(st.just(ctx), st.integers(1, ctx))),
        min_size=1,
        max_size=5,
    ),
    block_size=st.sampled_from([1, 2, 4, 8]),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
    sliding_window=st.none() | st.integers(1, 50),
    logit_softcap=st.none() | st.floats(0.5, 50.0),
    seed=st.integers(0, 2**16),
)
def test_random_batches_match_dense(
    seqs: list[tuple[int, int]],
    block_size: int,
    heads: tuple[int, int],
    sliding_window: int | None,
    logit_softcap: float | None,
    seed: int,
) -> None:
    """Any mix of prompts, chunks and decodes, block sizes down to 1, any window: equal to dense attention."""
    case = make_case(
        seqs,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=4,
        block_size=block_size,
        seed=seed,
        poison_unused=True,
    )
    out = prefill(
        case,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )
    ref = reference_attention(case, sliding_window=sliding_window, logit_softcap=logit_softcap)
    assert relative_error(out, ref) < 1e-5
