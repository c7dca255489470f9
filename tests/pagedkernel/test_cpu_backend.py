"""The cpu backend's C kernel against the float64 reference and the torch backend, its fallbacks and its build.

Every case poisons the cache slots outside the contexts with NaN and preallocates the output full of NaN, so a
kernel that reads an unwritten slot or skips an output element fails. Contexts cross block boundaries (1,
block_size, block_size + 1, ~300 tokens) and the prefill batches mix fresh prompts, prefix-cache hits and chunks.
The compiler is gcc/cc; these tests fail (they do not skip) on a machine without one, like the engine's default.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pagoda.pagedkernel import BackendUnavailableError, KernelBackend, cbuild, cpu_backend, get_backend
from pagoda.pagedkernel.cbuild import for_march
from pagoda.pagedkernel.cpu_backend import CpuBackend
from pagoda.pagedkernel.testing import AttentionConfig as Case
from pagoda.pagedkernel.testing import PagedCase, make_case, reference_attention, relative_error
from pagoda.pagedkernel.torch_backend import TorchBackend

TORCH = TorchBackend()


@pytest.fixture(scope="module")
def cpu() -> CpuBackend:
    """One cpu backend for the module, so that each dtype's library is loaded once."""
    backend = CpuBackend()
    _ops: KernelBackend = backend  # mypy proves that the class satisfies the shared interface
    return backend


CASES = [
    Case(64, 8, 1, None, None),
    Case(64, 16, 4, 32, None),
    Case(128, 32, 1, None, 30.0),
    Case(128, 8, 4, 100, 50.0),
    Case(256, 16, 1, 40, None),
    Case(256, 16, 4, None, 20.0),
    Case(
        40, 16, 3, None, None
    ),  # head_dim a multiple of 8 but not 16, a group the kernel is not specialised for
    Case(32, 4, 8, 7, None),  # a group of 8: decode rows fill a tile
    Case(16, 16, 16, None, None),  # a group above the tile: prefill tiles of one token
    # AVX-512's 32-column loops with columns left over: for 8- and 16-column tails, over 8-row prefill tiles.
    Case(96, 16, 2, None, None),
    Case(80, 8, 1, 50, None),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative error against float64: float32 accumulates in a different order; half precision rounds q/K/V/out.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _case(case: Case, seqs: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0) -> PagedCase:
    return make_case(
        seqs,
        num_heads=2 * case.group,
        num_kv_heads=2,
        head_dim=case.head_dim,
        block_size=case.block_size,
        dtype=dtype,
        seed=seed,
        poison_unused=True,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_matches_reference(cpu: CpuBackend, case: Case, dtype: torch.dtype) -> None:
    """A varlen batch: one-token and block-sized prompts, a cache hit, a chunk of a long context, a long prompt."""
    bs = case.block_size
    c = _case(case, [(1, 1), (bs, bs), (bs + 1, 3), (300, 24), (130, 130)], dtype)
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    window, softcap = case.sliding_window, case.logit_softcap
    out = torch.full_like(c.q, float("nan"))
    assert cpu.paged_prefill_attention(*args, sliding_window=window, logit_softcap=softcap, out=out) is out
    assert out.dtype == dtype
    ref = reference_attention(c, sliding_window=window, logit_softcap=softcap)
    assert relative_error(out, ref) < TOLERANCE[dtype]
    torch_out = TORCH.paged_prefill_attention(*args, sliding_window=window, logit_softcap=softcap)
    assert relative_error(out, torch_out) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_matches_reference(cpu: CpuBackend, case: Case, dtype: torch.dtype) -> None:
    """One query per sequence at its last position, contexts across block boundaries."""
    bs = case.block_size
    c = _case(case, [(n, 1) for n in (1, bs, bs + 1, 300, 77)], dtype, seed=1)
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.context_lens, c.scale)
    window, softcap = case.sliding_window, case.logit_softcap
    out = torch.full_like(c.q, float("nan"))
    assert cpu.paged_decode_attention(*args, sliding_window=window, logit_softcap=softcap, out=out) is out
    assert (
        relative_error(out, reference_attention(c, sliding_window=window, logit_softcap=softcap))
        < TOLERANCE[dtype]
    )


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
@pytest.mark.parametrize("case", [CASES[5], CASES[6], CASES[9]], ids=str)
def test_narrower_builds_agree_with_the_reference(case: Case, march: str) -> None:
    """The kernel built for AVX2 (256-bit loops, no AVX-512 paths) and for any x86-64 (the generic vector code)
    computes the reference's attention too, for one-token and longer queries, in bfloat16."""
    flags = for_march(cpu_backend.CFLAGS, march)
    kernels = cpu_backend.load(cpu_backend.build(torch.bfloat16, cflags=flags))
    bs = case.block_size
    c = _case(case, [(1, 1), (bs + 1, 3), (300, 24), (130, 130)], torch.bfloat16, seed=2)
    window, softcap = case.sliding_window, case.logit_softcap
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    out = cpu_backend._attention(*args, window, softcap, None, kernels)
    ref = reference_attention(c, sliding_window=window, logit_softcap=softcap)
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(
    "avx512_bf16" not in cbuild.cpu_flags(), reason="the bfloat16 dot products need AVX-512 BF16"
)
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5], CASES[7]], ids=str)
def test_bfloat16_dot_products_run_and_agree_with_the_float32_loops(case: Case) -> None:
    """On a CPU with AVX-512 BF16 the bfloat16 library takes its scores and P @ V by vdpbf16ps (head_dim a
    multiple of 32): its output is not the float32 loops' (built with -mno-avx512bf16), so the path runs, and both
    are the reference's attention within bfloat16's error."""
    native = cpu_backend.load(cpu_backend.build(torch.bfloat16))
    loops = cpu_backend.load(
        cpu_backend.build(torch.bfloat16, cflags=(*cpu_backend.CFLAGS, "-mno-avx512bf16"))
    )
    bs = case.block_size
    c = _case(case, [(1, 1), (bs + 1, 3), (300, 24), (130, 130), (77, 1)], torch.bfloat16, seed=3)
    window, softcap = case.sliding_window, case.logit_softcap
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    ref = reference_attention(c, sliding_window=window, logit_softcap=softcap)
    outs = [cpu_backend._attention(*args, window, softcap, None, kernels) for kernels in (native, loops)]
    assert not torch.equal(outs[0], outs[1])
    for out in outs:
        assert out.isfinite().all()
        assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]


def test_result_does_not_depend_on_the_thread_count(cpu: CpuBackend) -> None:
    """Each work item runs whole on one thread, so 1, 2 or 7 threads give bitwise the same output."""
    c = _case(CASES[1], [(300, 1)] * 9 + [(200, 40), (64, 64)], torch.float32)
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 7):
            torch.set_num_threads(n)
            results.append(cpu.paged_prefill_attention(*args, sliding_window=32))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_strided_query_and_output(cpu: CpuBackend) -> None:
    """q sliced out of a fused QKV projection and an `out` view that is not contiguous are handled."""
    c = _case(CASES[0], [(20, 1), (33, 1)], torch.float32)
    fused = torch.cat([c.q, torch.randn_like(c.q)], dim=-1)  # [num_seqs, num_heads, 2 * head_dim]
    q = fused[..., : c.q.shape[-1]]
    assert not q.is_contiguous()
    holder = torch.full((c.q.shape[0], c.q.shape[1], 2 * c.q.shape[2]), float("nan"))
    out = holder[..., : c.q.shape[-1]]
    args = (c.k_cache, c.v_cache, c.block_tables, c.context_lens, c.scale)
    assert cpu.paged_decode_attention(q, *args, out=out) is out
    assert relative_error(out, reference_attention(c)) < 1e-5
    assert holder[..., c.q.shape[-1] :].isnan().all()  # nothing written outside the view


def test_empty_batch(cpu: CpuBackend) -> None:
    """No sequences: an empty output and no kernel work."""
    c = _case(CASES[0], [(5, 1)], torch.float32)
    empty = torch.empty(0, c.q.shape[1], c.q.shape[2])
    out = cpu.paged_decode_attention(
        empty, c.k_cache, c.v_cache, c.block_tables[:0], c.context_lens[:0], c.scale
    )
    assert out.shape == empty.shape


@pytest.mark.parametrize(
    ("head_dim", "q_dtype"),
    [(12, torch.float32), (520, torch.float32), (64, torch.float64), (64, torch.bfloat16)],
    ids=["head_dim-12", "head_dim-520", "float64", "q-bfloat16-cache-float32"],
)
def test_what_the_kernel_does_not_take_runs_through_torch(
    cpu: CpuBackend, head_dim: int, q_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unsupported head sizes and dtypes are answered by the torch backend, correctly."""
    cache_dtype = torch.float64 if q_dtype == torch.float64 else torch.float32
    c = make_case(
        [(20, 20), (40, 1)], num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=8, dtype=cache_dtype
    )
    q = c.q.to(q_dtype)
    assert not cpu_backend.supported(q, c.k_cache)

    def refuse(self: CpuBackend, dtype: torch.dtype) -> None:
        raise AssertionError("the C kernel was called")

    monkeypatch.setattr(CpuBackend, "kernels", refuse)
    args = (q, c.k_cache, c.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    out = cpu.paged_prefill_attention(*args)
    assert relative_error(out, TORCH.paged_prefill_attention(*args)) == 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_writes_rows_and_skips_padding(cpu: CpuBackend, dtype: torch.dtype) -> None:
    """Keys and values land in their slots (strided token rows, as sliced out of a fused projection, included),
    negative slots write nothing, and every other slot is untouched: the torch backend's result, bitwise."""
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(6, 3, 2, 16, generator=gen).to(dtype)  # [tokens, (q, k, v), kv_heads, head_dim]
    key, value = fused[:, 1], fused[:, 2]
    assert not key.is_contiguous()
    slots = torch.tensor([5, -1, 0, 31, 17, -3])
    k_cache, v_cache = (torch.randn(4, 8, 2, 16, generator=gen).to(dtype) for _ in range(2))
    k_want, v_want = k_cache.clone(), v_cache.clone()
    TORCH.reshape_and_cache(key, value, k_want, v_want, slots)
    cpu.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


def test_reshape_and_cache_refuses_an_out_of_range_slot_and_writes_nothing(cpu: CpuBackend) -> None:
    """A slot past the cache is an IndexError naming it, raised before any row is written."""
    key = torch.randn(3, 2, 16)
    k_cache, v_cache = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
    with pytest.raises(IndexError, match="slot 32 of token 2 is outside the cache's 32 slots"):
        cpu.reshape_and_cache(key, key, k_cache, v_cache, torch.tensor([1, 2, 32]))
    assert not k_cache.any() and not v_cache.any()


def test_reshape_and_cache_other_dtypes_go_through_torch(cpu: CpuBackend) -> None:
    """A key dtype other than the cache's is converted by the torch backend, as it always was."""
    key = torch.randn(2, 2, 16, dtype=torch.float64)
    k_cache, v_cache = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
    cpu.reshape_and_cache(key, key, k_cache, v_cache, torch.tensor([3, 9]))
    assert torch.equal(k_cache.view(-1, 2, 16)[[3, 9]], key.float())


def test_build_is_cached_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first build compiles into the cache folder; later builds, here or in another process, reuse the file."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    path = cpu_backend.build(torch.float32)
    assert path.parent == tmp_path and path.suffix == ".so"
    # gcc has OpenMP: the kernel links libgomp, which resolves to the copy torch loaded (one thread pool).
    assert "libgomp" in subprocess.run(["ldd", str(path)], capture_output=True, text=True).stdout
    mtime = path.stat().st_mtime_ns
    assert cpu_backend.build(torch.float32) == path
    code = "import torch; from pagoda.pagedkernel import cpu_backend; print(cpu_backend.build(torch.float32))"
    child = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PAGODA_KERNEL_CACHE": str(tmp_path)},
    )
    assert Path(child.stdout.strip()) == path
    assert path.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left behind


def test_pthreads_build_equals_the_openmp_build(
    cpu: CpuBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler without OpenMP gets the pthreads version of the kernel: bitwise the same outputs."""
    c = _case(CASES[1], [(300, 1)] * 5 + [(200, 40), (64, 64)], torch.float32)
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    openmp = cpu.paged_prefill_attention(*args, sliding_window=32)
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_backend, "OPENMP_FLAGS", ("-fno-such-openmp-flag",))  # fails: falls back
    library = cpu_backend.build(torch.float32)
    assert "gomp" not in subprocess.run(["ldd", str(library)], capture_output=True, text=True).stdout
    pthreads = cpu_backend._attention(*args, 32, None, None, kernels=cpu_backend.load(library))
    assert torch.equal(pthreads, openmp)


def test_missing_compiler_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler: get_backend('cpu') says to install gcc or use torch; 'auto' warns and falls back to torch."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    assert cbuild.find_compiler() is None
    with pytest.raises(BackendUnavailableError, match=r"no C compiler; install gcc"):
        get_backend("cpu", "cpu")
    assert get_backend("auto", "cpu").name == "torch"


def test_failing_compiler_reports_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A compiler that fails: the error carries its exit status; available() logs it and answers False."""
    script = tmp_path / "badcc"
    script.write_text("#!/bin/sh\necho 'badcc: cannot compile' >&2\nexit 3\n")
    script.chmod(0o755)
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(script))
    with pytest.raises(BackendUnavailableError, match=r"(?s)exit 3.*badcc: cannot compile"):
        cpu_backend.build(torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        assert not CpuBackend().available()  # a fresh backend, which has loaded no library yet
    assert "attention runs through torch" in caplog.text


def test_registry_picks_cpu_on_the_cpu_and_refuses_cuda() -> None:
    """'auto' on a CPU with a compiler is the cpu backend; asking for it on CUDA says where it runs."""
    assert get_backend("auto", "cpu").name == "cpu"
    assert get_backend("cpu", "cpu").name == "cpu"
    assert type(get_backend("cpu", "cpu")) is CpuBackend
    with pytest.raises(BackendUnavailableError, match="runs on the CPU"):
        get_backend("cpu", "cuda")
