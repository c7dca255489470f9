"""A query row's attention does not depend on the rows it is computed with (batch invariance of the C kernel).

The C kernel cuts its work into items of several query rows (a prefill tile: a few tokens times a KV head's query
heads; a decode step: one token's query heads), and a speculative step verifies a token and its drafts as a tile
where plain decoding computed each token alone. Its tokens must be exactly plain decoding's, so each row's scores,
softmax and output are computed in an order that does not depend on how many rows share its item or where the
item's first row starts (sliding windows included): every query of a prefill, row for row, bitwise equals the same
query decoded alone over the same keys, on every build (AVX-512, AVX2, generic x86-64).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pagoda.pagedkernel import cpu_backend
from pagoda.pagedkernel.cbuild import for_march
from pagoda.pagedkernel.cpu_backend import CpuKernels
from pagoda.pagedkernel.testing import make_case

# (head_dim, block_size, group, sliding_window, softcap): groups of 1-16 give items of 1-16 rows (a group above 8
# leaves the AVX-512 loop for 8 rows), head dims with and without 16- and 32-column tails, windows that start
# inside a block.
CASES = [
    (64, 16, 1, None, None),
    (64, 16, 2, None, None),
    (64, 16, 3, 37, None),
    (64, 8, 4, None, 30.0),
    (256, 16, 4, 21, None),
    (80, 16, 2, None, None),
    (40, 16, 3, 50, None),
    (96, 8, 8, None, None),
    (32, 16, 16, 45, None),
]
MARCHES = ["native", "x86-64-v3", "x86-64"]


def _kernels(march: str, dtype: torch.dtype) -> CpuKernels:
    """The attention library of `dtype` built for `march` (cached on disk by its flags)."""
    flags = for_march(cpu_backend.CFLAGS, march)
    return cpu_backend.load(Path(cpu_backend.build(dtype, cflags=flags)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_prefill_row_equals_the_same_query_decoded_alone(
    case: tuple[int, int, int, int | None, float | None], march: str, dtype: torch.dtype
) -> None:
    """Eleven queries at the end of a 150-token context, as one prefill (tiles of several tokens), then each
    decoded alone at its own position: bitwise equal outputs."""
    head_dim, block_size, group, window, softcap = case
    kernels = _kernels(march, dtype)
    ctx, q_len = 150, 11
    c = make_case(
        [(ctx, q_len)],
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=head_dim + group,
        poison_unused=True,
    )
    paged = (c.k_cache, c.v_cache, c.block_tables)
    run = cpu_backend._attention
    together = run(c.q, *paged, c.query_start_loc, c.context_lens, c.scale, window, softcap, None, kernels)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for t in range(q_len):
        at = torch.tensor([ctx - q_len + t + 1], dtype=torch.int32)
        alone = run(c.q[t : t + 1], *paged, one, at, c.scale, window, softcap, None, kernels)
        assert torch.equal(alone[0], together[t]), f"query {t}: {(alone[0] - together[t]).abs().max()}"
