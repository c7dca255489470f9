"""Every backend (torch, Triton, CuPy) on CUDA, on the same random inputs: each op, three dtypes.

Attention is checked against a float64 dense reference and against the torch backend (the specification),
with outputs pre-filled with NaN (every element must be written) and unused cache slots poisoned with NaN (no
kernel may read them). Cache ops must equal the torch backend bit for bit. A backend whose library is missing
is skipped, not failed.
"""

from __future__ import annotations

from typing import TypedDict

import pytest
import torch
from pagoda.pagedkernel import BackendUnavailableError, KernelBackend, allocate_host_cache, get_backend
from pagoda.pagedkernel.testing import PagedCase, make_case, reference_attention, relative_error
from torch import Tensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BACKENDS = ("torch", "triton", "cupy")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Relative error (norm of the difference over norm of the reference) allowed per dtype.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


class Shape(TypedDict):
    """Attention and cache geometry, as `make_case` takes it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


SHAPES: dict[str, Shape] = {
    "gqa4-d128": {"num_heads": 8, "num_kv_heads": 2, "head_dim": 128, "block_size": 16},
    "mha-d64": {"num_heads": 4, "num_kv_heads": 4, "head_dim": 64, "block_size": 32},
    "mqa-d256": {"num_heads": 8, "num_kv_heads": 1, "head_dim": 256, "block_size": 16},
    "gqa2-d80": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 80, "block_size": 8},
    "many-seqs": {"num_heads": 16, "num_kv_heads": 4, "head_dim": 128, "block_size": 16},
}
# (shape, decode context lengths, sliding_window, logit_softcap). Contexts cross block boundaries (15/16/17
# with blocks of 16) and exceed the CuPy backend's 512-key partitions (split decode) in batches small enough to
# be split; "many-seqs" has enough (row, head) pairs that CuPy runs long contexts unsplit instead.
DECODE_CASES = [
    pytest.param("gqa4-d128", [1, 15, 16, 17, 600, 1500], None, None, id="gqa4-d128"),
    pytest.param("mha-d64", [5, 63, 64, 65, 900], 100, None, id="mha-d64-window"),
    pytest.param("mqa-d256", [3, 700, 2100], 700, 30.0, id="mqa-d256-window-softcap"),
    pytest.param("gqa2-d80", [1, 8, 9, 1030], None, 5.0, id="gqa2-d80-softcap"),
    pytest.param("many-seqs", [(37 * i) % 1200 + 1 for i in range(64)], None, None, id="many-seqs"),
]
# (context_len, q_len): a whole prompt, a chunk deep in a long context, a prefix-cache hit, decodes.
PREFILL_SEQS = [(700, 700), (1800, 300), (40, 8), (17, 1), (1, 1)]
PREFILL_CASES = [
    pytest.param("gqa4-d128", None, None, id="gqa4-d128"),
    pytest.param("mha-d64", 200, None, id="mha-d64-window"),
    pytest.param("mqa-d256", 500, 30.0, id="mqa-d256-window-softcap"),
    pytest.param("gqa2-d80", None, 5.0, id="gqa2-d80-softcap"),
]


def _backend(name: str) -> KernelBackend:
    """The named backend on CUDA, or a skip when its library is not installed."""
    try:
        return get_backend(name, "cuda")
    except BackendUnavailableError as exc:
        pytest.skip(f"{name} backend unavailable: {exc}")


def _strided_rows(
    q: Tensor,  # [num_rows, num_heads, head_dim]
) -> Tensor:  # [num_rows, num_heads, head_dim], a view with a padded row stride (as a slice of a QKV output)
    """The same values as a non-contiguous view, the layout a fused QKV projection hands to attention."""
    padded = torch.cat([q, torch.full_like(q, float("nan"))], dim=1)
    return padded[:, : q.shape[1]]


def _bits(t: Tensor) -> Tensor:
    """The raw bits of `t`, so that NaN slots compare equal."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _check_attention(out: Tensor, result: Tensor, expected: Tensor, case: PagedCase, spec: Tensor) -> None:
    """`result` is `out`, fully written, and close to the float64 reference and the torch backend."""
    assert result is out
    assert not out.isnan().any(), "an output element was not written (or a NaN cache slot was read)"
    tolerance = TOLERANCE[case.q.dtype]
    assert relative_error(out, expected) < tolerance
    assert relative_error(out, spec) < tolerance


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "lens", "sliding_window", "logit_softcap"), DECODE_CASES)
def test_decode(
    backend_name: str,
    dtype: torch.dtype,
    shape: str,
    lens: list[int],
    sliding_window: int | None,
    logit_softcap: float | None,
) -> None:
    """Decode attention of every backend matches the float64 reference and the torch backend."""
    ops = _backend(backend_name)
    case = make_case([(n, 1) for n in lens], **SHAPES[shape], dtype=dtype, device="cuda", poison_unused=True)
    args = (case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale)
    out = torch.full_like(case.q, float("nan"))
    result = ops.paged_decode_attention(
        _strided_rows(case.q), *args, sliding_window=sliding_window, logit_softcap=logit_softcap, out=out
    )
    spec = _backend("torch").paged_decode_attention(
        case.q, *args, sliding_window=sliding_window, logit_softcap=logit_softcap
    )
    expected = reference_attention(case, sliding_window=sliding_window, logit_softcap=logit_softcap)
    _check_attention(out, result, expected, case, spec)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "sliding_window", "logit_softcap"), PREFILL_CASES)
def test_prefill(
    backend_name: str, dtype: torch.dtype, shape: str, sliding_window: int | None, logit_softcap: float | None
) -> None:
    """Varlen causal prefill (whole prompts, chunks after cached context, decodes) matches the references."""
    ops = _backend(backend_name)
    case = make_case(PREFILL_SEQS, **SHAPES[shape], dtype=dtype, device="cuda", seed=1, poison_unused=True)
    args = (
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_start_loc,
        case.context_lens,
        case.scale,
    )
    out = torch.full_like(case.q, float("nan"))
    result = ops.paged_prefill_attention(
        _strided_rows(case.q), *args, sliding_window=sliding_window, logit_softcap=logit_softcap, out=out
    )
    spec = _backend("torch").paged_prefill_attention(
        case.q, *args, sliding_window=sliding_window, logit_softcap=logit_softcap
    )
    expected = reference_attention(case, sliding_window=sliding_window, logit_softcap=logit_softcap)
    _check_attention(out, result, expected, case, spec)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_decode_allocates_out(backend_name: str) -> None:
    """Without `out`, decode returns a new tensor of q's shape and dtype."""
    ops = _backend(backend_name)
    case = make_case([(20, 1), (3, 1)], **SHAPES["gqa4-d128"], dtype=torch.bfloat16, device="cuda")
    out = ops.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.1
    )
    assert out.shape == case.q.shape and out.dtype == case.q.dtype and out.data_ptr() != case.q.data_ptr()


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(backend_name: str, dtype: torch.dtype) -> None:
    """Keys and values sliced out of a fused QKV tensor land in their slots; padding slots are skipped."""
    ops = _backend(backend_name)
    num_blocks, block_size, num_kv_heads, head_dim = 20, 16, 2, 128
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(70, 8 + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).cuda()
    key, value = qkv[:, 8 : 8 + num_kv_heads], qkv[:, 8 + num_kv_heads :]
    # 30 consecutive slots across two block boundaries, 40 scattered distinct ones, every 9th token padding.
    perm = torch.randperm(num_blocks * block_size, generator=gen)
    slots = torch.cat([torch.arange(10, 40), perm[(perm < 10) | (perm >= 40)][:40]])
    slots[torch.arange(70) % 9 == 4] = -1
    slots = slots.cuda()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for _ in range(4)]
    ops.reshape_and_cache(key, value, caches[0], caches[1], slots)
    _backend("torch").reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(_bits(caches[0]), _bits(caches[2])) and torch.equal(_bits(caches[1]), _bits(caches[3]))
    written = (slots >= 0).sum().item()
    assert int((~caches[0].isnan()).all(dim=(2, 3)).sum()) == written


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks(backend_name: str, dtype: torch.dtype) -> None:
    """copy_blocks copies each (src, dst) block in every layer's K and V cache, and nothing else."""
    ops = _backend(backend_name)
    layers = [torch.randn(12, 16, 2, 64, device="cuda").to(dtype) for _ in range(6)]
    expected = [cache.clone() for cache in layers]
    pairs = torch.tensor([[1, 9], [7, 11], [0, 2], [3, 4]], device="cuda")
    ops.copy_blocks(layers[:3], layers[3:], pairs)
    _backend("torch").copy_blocks(expected[:3], expected[3:], pairs)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(layers, expected, strict=True))
    assert all(torch.equal(cache[9], cache[1]) and torch.equal(cache[4], cache[3]) for cache in layers)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks(backend_name: str, dtype: torch.dtype) -> None:
    """Blocks swapped out to a pinned host cache, back in, and within the device come back identical."""
    ops = _backend(backend_name)
    device_cache = torch.randn(32, 16, 2, 64, device="cuda").to(dtype)
    host = allocate_host_cache(8, 16, 2, 64, dtype)
    host.fill_(0)
    ops.swap_blocks(device_cache, host, torch.tensor([[5, 0], [31, 7]]))
    torch.cuda.synchronize()
    assert torch.equal(host[0], device_cache[5].cpu()) and torch.equal(host[7], device_cache[31].cpu())
    assert int((host != 0).any(dim=(1, 2, 3)).sum()) == 2
    restored = torch.zeros_like(device_cache)
    ops.swap_blocks(host, restored, torch.tensor([[0, 3], [7, 4]]))
    ops.swap_blocks(device_cache, restored, torch.tensor([[10, 20]]))
    torch.cuda.synchronize()
    assert torch.equal(restored[3], device_cache[5]) and torch.equal(restored[4], device_cache[31])
    assert torch.equal(restored[20], device_cache[10])
    assert int((restored != 0).any(dim=(1, 2, 3)).sum()) == 3
