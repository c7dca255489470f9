"""The sampling kernel, as its launcher configures it, compiles to a cubin for sm_90 (H100/H200) on this CPU machine
(see test_triton_compile.py for why the interpreter is not enough). Runs in a fresh interpreter without
TRITON_INTERPRET, through Triton's own argument binder and compiler down to ptxas."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

TARGET_ARCH = 90


def compile_all() -> None:
    """Record the launches of every dtype with and without the mask, and compile each for sm_TARGET_ARCH."""
    from pagoda.pagedkernel.sampling import SamplingTensors, triton_sampling
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    launches: list[tuple[Any, tuple[object, ...], dict[str, object]]] = []

    def record(kernel: Any, grid: tuple[int, ...], *args: object, **meta: object) -> None:
        launches.append((kernel, args, meta))

    triton_sampling._launch = record  # this process exists only to compile, nothing is launched
    params = SamplingTensors.build(temperature=[0.0, 1.0], keys=[1, 2], top_k=[None, 5], top_p=[1.0, 0.9])
    args = (params.inverse_temperature(), params.top_k, params.top_p, params.min_p, params.keys)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for with_mask in (False, True):
            triton_sampling.run(torch.zeros(2, 262_144, dtype=dtype), *args, with_mask=with_mask)
    target = GPUTarget("cuda", TARGET_ARCH, 32)
    backend = make_backend(target)
    for kernel, kernel_args, meta in launches:
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*kernel_args, **meta)
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, dict(meta), bound, specialization, options
        )
        compiled = compile(
            ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__
        )
        print(f"compiled {kernel.__name__}: {compiled.metadata.num_warps} warps")


@pytest.mark.slow
def test_sampling_kernel_compiles_for_sm90() -> None:
    """Six launches (three dtypes, with and without the mask) compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("compiled sample_kernel:") == 6, result.stdout


if __name__ == "__main__":
    compile_all()
