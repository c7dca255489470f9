"""A sliding-window layer's attention reads only its window's blocks, on every backend: table entries before the
window point at a NaN-filled block (what the hybrid KV cache manager's null block may hold) and the output still
equals the reference over the real blocks. Triton runs interpreted on the CPU (small shapes), CuPy on CUDA only."""

from __future__ import annotations

import pytest
import torch
from pagoda.pagedkernel import BackendUnavailableError, KernelBackend, get_backend
from pagoda.pagedkernel.cbuild import CompileError
from pagoda.pagedkernel.testing import PagedCase, make_case, reference_attention, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS = 8
WINDOW = 20


def backend_or_skip(name: str) -> KernelBackend:
    """The named backend on this machine's device, or a skip naming why it cannot run here (no library, no
    device, no C compiler); a C kernel that fails to compile is a failure, with the compiler's output."""
    try:
        return get_backend(name, DEVICE)
    except CompileError:
        raise
    except BackendUnavailableError as err:
        pytest.skip(str(err))


def with_null_entries(case: PagedCase) -> PagedCase:
    """The case with one NaN block appended and every table entry wholly before its first query's window
    pointing at it (the entries a released window leaves behind)."""
    k = torch.cat([case.k_cache, torch.full_like(case.k_cache[:1], float("nan"))])
    v = torch.cat([case.v_cache, torch.full_like(case.v_cache[:1], float("nan"))])
    null = k.shape[0] - 1
    tables = case.block_tables.clone()
    q_lens = (case.query_start_loc[1:] - case.query_start_loc[:-1]).tolist()
    for i, (ctx, q_len) in enumerate(zip(case.context_lens.tolist(), q_lens, strict=True)):
        first_key = max(0, ctx - q_len - WINDOW + 1)  # the first query sits at ctx - q_len
        tables[i, : first_key // BS] = null
    return PagedCase(case.q, k, v, tables, case.query_start_loc, case.context_lens, case.scale)


@pytest.mark.parametrize("name", ["torch", "cpu", "triton", "cupy"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_window_reads_skip_the_blocks_before_it(name: str, phase: str) -> None:
    """NaN before the window never reaches the output, and the output is the reference's."""
    backend = backend_or_skip(name)
    seqs = [(77, 1), (100, 1), (23, 1)] if phase == "decode" else [(77, 5), (100, 17), (23, 23)]
    case = make_case(seqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=BS, device=DEVICE)
    ref = reference_attention(case, sliding_window=WINDOW)
    null = with_null_entries(case)
    assert bool((null.block_tables == null.k_cache.shape[0] - 1).any())
    if phase == "decode":
        out = backend.paged_decode_attention(
            null.q,
            null.k_cache,
            null.v_cache,
            null.block_tables,
            null.context_lens,
            null.scale,
            sliding_window=WINDOW,
        )
    else:
        out = backend.paged_prefill_attention(
            null.q,
            null.k_cache,
            null.v_cache,
            null.block_tables,
            null.query_start_loc,
            null.context_lens,
            null.scale,
            sliding_window=WINDOW,
        )
    assert not bool(out.isnan().any())
    assert relative_error(out, ref) < 1e-4
