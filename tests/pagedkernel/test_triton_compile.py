"""Every Triton kernel, as the launchers configure it, compiles to a cubin for sm_90 (H100/H200) on this CPU machine.

The interpreter runs kernels as Python, so it misses what only the compiler rejects (non-constexpr globals,
loop-carried values changing type under Triton's specialisation of integer arguments equal to 1, tile
shapes tl.dot refuses). Here the launchers run on CPU tensors with `_launch` recording instead of launching,
and each recorded launch goes through Triton's own argument binder (the same specialisation as a real launch)
and compiler, down to ptxas. This needs a compiled (not interpreted) Triton, so it runs in a fresh interpreter
without TRITON_INTERPRET. It uses Triton internals (`create_function_from_signature`, `JITFunction._pack_args`)
that a Triton upgrade may move.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

TARGET_ARCH = 90


def _record_launches() -> list[tuple[Any, tuple[object, ...], dict[str, object]]]:
    """Run every launcher on CPU tensors in the configurations the engine uses, recording the launches."""
    from pagoda.pagedkernel import triton_backend
    from pagoda.pagedkernel.testing import make_case

    launches: list[tuple[Any, tuple[object, ...], dict[str, object]]] = []

    def record(kernel: Any, grid: tuple[int, ...], *args: object, **meta: object) -> None:
        launches.append((kernel, args, meta))

    triton_backend._launch = record  # this process exists only to compile, nothing is launched
    backend = triton_backend.TritonBackend()
    configs: list[tuple[dict[str, Any], int | None, float | None]] = [
        (
            {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16, "dtype": torch.bfloat16},
            None,
            None,
        ),
        (
            {"num_heads": 4, "num_kv_heads": 4, "head_dim": 64, "block_size": 16, "dtype": torch.float32},
            1,
            30.0,
        ),
        (
            {"num_heads": 8, "num_kv_heads": 2, "head_dim": 256, "block_size": 32, "dtype": torch.float16},
            512,
            50.0,
        ),
        (
            {"num_heads": 8, "num_kv_heads": 1, "head_dim": 80, "block_size": 16, "dtype": torch.bfloat16},
            None,
            None,
        ),
    ]
    for shape, window, softcap in configs:
        c = make_case([(1, 1), (17, 3), (2000, 1)], **shape)
        backend.paged_prefill_attention(
            c.q,
            c.k_cache,
            c.v_cache,
            c.block_tables,
            c.query_start_loc,
            c.context_lens,
            c.scale,
            sliding_window=window,
            logit_softcap=softcap,
        )
        decode_q = c.q[c.query_start_loc[1:].long() - 1]
        backend.paged_decode_attention(
            decode_q,
            c.k_cache,
            c.v_cache,
            c.block_tables,
            c.context_lens,
            c.scale,
            sliding_window=window,
            logit_softcap=softcap,
        )
        if shape["head_dim"] == 128:
            key = c.q[:5, :8]
            backend.reshape_and_cache(key, key, c.k_cache, c.v_cache, torch.arange(5))
            backend.copy_blocks([c.k_cache], [c.v_cache], torch.tensor([[0, 1]]))
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):  # --kv-cache-dtype fp8 under bfloat16 activations
        shape = {
            "num_heads": 8,
            "num_kv_heads": 2,
            "head_dim": 128,
            "block_size": 16,
            "dtype": torch.bfloat16,
        }
        c = make_case([(1, 1), (17, 3), (300, 1)], **shape)
        k, v = c.k_cache.to(fp8), c.v_cache.to(fp8)
        backend.paged_prefill_attention(
            c.q, k, v, c.block_tables, c.query_start_loc, c.context_lens, c.scale, sliding_window=64
        )
        decode_q = c.q[c.query_start_loc[1:].long() - 1]
        backend.paged_decode_attention(decode_q, k, v, c.block_tables, c.context_lens, c.scale)
        key = c.q[:5, :2]
        backend.reshape_and_cache(key, key, k, v, torch.arange(5))
    for dtype, head_dim in (
        (torch.bfloat16, 256),
        (torch.float16, 128),
    ):  # --kv-cache-dtype int8 (Gemma 3: 256)
        c = make_case(
            [(1, 1), (17, 3), (300, 1)],
            num_heads=4,
            num_kv_heads=1,
            head_dim=head_dim,
            block_size=16,
            dtype=dtype,
        )
        k, v = c.k_cache.to(torch.int8), c.v_cache.to(torch.int8)
        blocks, block_size = k.shape[0], k.shape[1]
        k_scale = torch.ones(blocks, 1, head_dim, dtype=torch.bfloat16)
        v_scale = torch.ones(blocks, block_size, 1)
        backend.paged_prefill_attention(
            c.q,
            k,
            v,
            c.block_tables,
            c.query_start_loc,
            c.context_lens,
            c.scale,
            sliding_window=64,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        decode_q = c.q[c.query_start_loc[1:].long() - 1]
        backend.paged_decode_attention(
            decode_q, k, v, c.block_tables, c.context_lens, c.scale, k_scale=k_scale, v_scale=v_scale
        )
    return launches


def compile_all() -> None:
    """Compile each distinct recorded launch for sm_TARGET_ARCH; raise on the first compiler error."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", TARGET_ARCH, 32)
    backend = make_backend(target)
    seen = set()
    for kernel, args, meta in _record_launches():
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **meta)
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, dict(meta), bound, specialization, options
        )
        key = (kernel.__name__, str(signature), str(sorted(constexprs.items())), str(attrs))
        if key in seen:
            continue
        seen.add(key)
        compiled = compile(
            ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__
        )
        print(
            f"compiled {kernel.__name__}: {compiled.metadata.num_warps} warps, {compiled.metadata.shared} B smem"
        )


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    """The compile run succeeds for every kernel the launchers start."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    compiled = result.stdout.count("compiled ")
    for name in ("paged_prefill_kernel", "paged_decode_kernel", "paged_decode_reduce_kernel"):
        assert f"compiled {name}:" in result.stdout
    assert (
        "compiled reshape_and_cache_kernel:" in result.stdout
        and "compiled copy_blocks_kernel:" in result.stdout
    )
    assert compiled >= 10, result.stdout
    # The fp8 caches' kernels (e4m3, e5m2) on top of the four float configurations and the one float write, and
    # the two int8 caches' attention (their writes are the torch reference's).
    assert result.stdout.count("compiled reshape_and_cache_kernel:") == 3, result.stdout
    assert result.stdout.count("compiled paged_prefill_kernel:") == 8, result.stdout


if __name__ == "__main__":
    compile_all()
