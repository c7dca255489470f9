"""The Triton backend compiled on CUDA against the torch backend, including bfloat16 and host <-> device swaps."""

from __future__ import annotations

import pytest
import torch
from pagoda.pagedkernel import allocate_host_cache, get_backend
from pagoda.pagedkernel.testing import PagedCase, make_case, relative_error
from pagoda.pagedkernel.torch_backend import TorchBackend
from pagoda.pagedkernel.triton_backend import TritonBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TORCH, TRITON = TorchBackend(), TritonBackend()
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _llama_case(seqs: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0) -> PagedCase:
    """Llama-3-8B attention (32 query heads over 8 KV heads of 128 dims) in blocks of 16 tokens, on CUDA."""
    return make_case(
        seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype, seed=seed, device="cuda"
    )


def test_auto_is_triton_on_cuda() -> None:
    """'auto' on a CUDA device picks the Triton backend."""
    assert get_backend("auto", "cuda").name == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("sliding_window", "logit_softcap"), [(None, None), (1000, 30.0)])
def test_decode_long_contexts(
    dtype: torch.dtype, sliding_window: int | None, logit_softcap: float | None
) -> None:
    """Decode over contexts of 1 to 5,000 tokens (several 512-key partitions), Llama-3-8B shapes."""
    seqs = [(n, 1) for n in (1, 16, 17, 511, 513, 2048, 5000)]
    c = _llama_case(seqs, dtype)
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.context_lens, c.scale)
    out = torch.full_like(c.q, float("nan"))
    TRITON.paged_decode_attention(*args, sliding_window=sliding_window, logit_softcap=logit_softcap, out=out)
    ref = TORCH.paged_decode_attention(*args, sliding_window=sliding_window, logit_softcap=logit_softcap)
    assert out.dtype == dtype
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("sliding_window", "logit_softcap"), [(None, None), (300, 50.0)])
def test_prefill_varlen(dtype: torch.dtype, sliding_window: int | None, logit_softcap: float | None) -> None:
    """A 1,500-token prompt, a chunk of a long context, a prefix hit and decodes in one varlen batch."""
    seqs = [(1500, 1500), (3000, 700), (40, 8), (9, 1), (1, 1)]
    c = _llama_case(seqs, dtype, seed=2)
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    out = torch.full_like(c.q, float("nan"))
    TRITON.paged_prefill_attention(*args, sliding_window=sliding_window, logit_softcap=logit_softcap, out=out)
    ref = TORCH.paged_prefill_attention(*args, sliding_window=sliding_window, logit_softcap=logit_softcap)
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("head_dim", [64, 80, 256])
def test_other_head_dims(head_dim: int) -> None:
    """Head dims padded to a power of two (80) and the largest tile (256), GQA 4 and MQA."""
    for num_kv_heads in (2, 1):
        c = make_case(
            [(700, 300), (33, 1)],
            num_heads=8,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=32,
            dtype=torch.bfloat16,
            device="cuda",
        )
        args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
        out = TRITON.paged_prefill_attention(*args)
        assert relative_error(out, TORCH.paged_prefill_attention(*args)) < 2e-2


def test_cache_ops_on_cuda() -> None:
    """reshape_and_cache and the one-launch copy_blocks equal the torch backend bit for bit in bfloat16."""
    key = torch.randn(50, 8, 128, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(64 * 16, device="cuda")[:50]
    slots[::7] = -1
    caches = [torch.zeros(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    TRITON.reshape_and_cache(key, value, caches[0], caches[1], slots)
    TORCH.reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    layers = [torch.randn(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    expected = [c.clone() for c in layers]
    pairs = torch.tensor([[1, 40], [7, 63], [0, 2]], device="cuda")
    TRITON.copy_blocks(layers[:4], layers[4:], pairs)
    TORCH.copy_blocks(expected[:4], expected[4:], pairs)
    assert all(torch.equal(a, b) for a, b in zip(layers, expected, strict=True))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_swap_to_pinned_host_and_back(backend: str) -> None:
    """Blocks swapped out to a pinned host cache and back in (async copies) come back identical."""
    ops = get_backend(backend, "cuda")
    device_cache = torch.randn(32, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    host = allocate_host_cache(8, 16, 8, 128, torch.bfloat16)
    assert host.is_pinned()
    ops.swap_blocks(device_cache, host, torch.tensor([[5, 0], [31, 7]]))
    torch.cuda.synchronize()
    assert torch.equal(host[0], device_cache[5].cpu()) and torch.equal(host[7], device_cache[31].cpu())
    restored = torch.zeros_like(device_cache)
    ops.swap_blocks(host, restored, torch.tensor([[0, 3], [7, 4]]))
    torch.cuda.synchronize()
    assert torch.equal(restored[3], device_cache[5]) and torch.equal(restored[4], device_cache[31])
    assert int((restored != 0).any(dim=(1, 2, 3)).sum()) == 2
