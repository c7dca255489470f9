"""cbuild on its own: any C source with its caller's flags, compiled once into the cache, alternatives in order.

The cpu backend's build through it (OpenMP, the pthreads fallback, the missing or failing compiler) is tested in
test_cpu_backend.py; these tests use a one-function source, as a second C kernel would bring its own. The last
ones check the C kernels' shared header: inlined by `csrc.read_source`, so the text cbuild hashes carries it.
"""

from __future__ import annotations

import ctypes
import logging
import pickle
import unittest
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pagoda.pagedkernel import BackendUnavailableError, cbuild, cpu_backend, csrc, get_backend
from pagoda.pagedkernel.cpu_backend import CpuBackend
from pagoda.pagedkernel.fused import cpu_fused
from pagoda.pagedkernel.lora import cpu_lora
from pagoda.pagedkernel.quant import cpu_quant
from pagoda.pagedkernel.sampling import sampler, token_bitmask
from pagoda.pagedkernel.testing import c_kernel_or_skip

SOURCE = "int pagoda_answer(void) { return ANSWER; }\n"


def _answer(library: Path) -> int:
    """What the compiled `pagoda_answer` returns."""
    function = ctypes.CDLL(str(library)).pagoda_answer
    function.restype = ctypes.c_int
    return int(function())


def _build(
    flags: tuple[str, ...], alternatives: tuple[tuple[str, ...], ...] = ((),), source: str = SOURCE
) -> Path:
    """`source` built as `answer.c` with `flags` (and `alternatives`), errors worded for a test owner."""
    return cbuild.build(
        "answer.c",
        source,
        flags,
        variant="test",
        owner="the answer kernel",
        instead="use the Python answer",
        alternatives=alternatives,
    )


def test_flags_reach_the_compiler_and_each_set_has_its_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's -D flag is compiled in; other flags give another library; the same flags reuse the file."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    first = _build(("-O2", "-DANSWER=42"))
    assert first.parent == tmp_path and first.name.startswith("answer_test_") and first.suffix == ".so"
    assert _answer(first) == 42
    mtime = first.stat().st_mtime_ns
    assert _build(("-O2", "-DANSWER=42")) == first and first.stat().st_mtime_ns == mtime
    second = _build(("-O2", "-DANSWER=7"))
    assert second != first and _answer(second) == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, second.name])


WIDEST = """
int pagoda_answer(void) {
#if defined(__AVX512F__)
  return 512;
#elif defined(__AVX2__)
  return 256;
#else
  return 128;
#endif
}
"""


@pytest.mark.skipif(not cbuild.cpu_flags() >= {"avx2"}, reason="the x86-64-v3 build runs on AVX2 CPUs only")
def test_cpu_march_replaces_native(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PAGODA_CPU_MARCH rebuilds -march=native kernels for that target (their own library); unset: native again."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("PAGODA_CPU_MARCH", "x86-64-v3")
    v3 = _build(("-O2", "-march=native"), source=WIDEST)
    assert _answer(v3) == 256
    monkeypatch.setenv("PAGODA_CPU_MARCH", "x86-64")
    assert _answer(_build(("-O2", "-march=native"), source=WIDEST)) == 128
    monkeypatch.delenv("PAGODA_CPU_MARCH")
    native = _build(("-O2", "-march=native"), source=WIDEST)
    assert native != v3
    assert _answer(native) == (512 if "avx512f" in cbuild.cpu_flags() else 256)


def test_for_march_replaces_only_native() -> None:
    """for_march (the tests' other builds, and PAGODA_CPU_MARCH's) swaps -march=native and leaves other flags."""
    flags = ("-O3", "-march=native", "-fopenmp", "-march=nativex")
    assert cbuild.for_march(flags, "x86-64-v3") == ("-O3", "-march=x86-64-v3", "-fopenmp", "-march=nativex")
    assert cbuild.for_march(flags, "native") == flags


def test_alternatives_are_tried_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing first alternative falls back to the next; when all fail, the error names owner and fallback."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    library = _build(("-DANSWER=5",), (("-fno-such-flag",), ("-DUNUSED",)))
    assert _answer(library) == 5
    with pytest.raises(
        BackendUnavailableError,
        match=r"(?s)compiling the answer kernel's answer.c for test failed.*use the Python",
    ):
        _build(("-DANSWER=5",), (("-fno-such-flag",), ("-fno-other-flag",)))


def test_no_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a compiler the error says to install gcc or fall back, in the caller's words."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(
        BackendUnavailableError, match=r"the answer kernel compiles a C kernel.*use the Python"
    ):
        _build(("-DANSWER=1",))


# Every C kernel's load as its tests reach it (through the cache-less function under a functools.cache), and the
# runtime's check that answers False (`auto` then runs torch) instead of raising.
# The loaders without their per-process caches (the test's compiler must be asked every time).
UNCACHED_KERNELS = {
    cpu_quant: cpu_quant.kernels.__wrapped__,
    cpu_lora: cpu_lora.kernels.__wrapped__,
    cpu_fused: cpu_fused.kernels.__wrapped__,
}

KERNEL_LOADS: dict[str, tuple[Callable[[], object], Callable[[], bool]]] = {
    "attention": (lambda: get_backend("cpu", "cpu"), lambda: CpuBackend().available()),
    "attention-int8": (
        lambda: cpu_backend.build(torch.bfloat16, int8_cache=True),
        lambda: CpuBackend().available(),
    ),
    "quant": (UNCACHED_KERNELS[cpu_quant], cpu_quant.available.__wrapped__),
    "lora": (
        lambda: UNCACHED_KERNELS[cpu_lora](torch.float32),
        lambda: cpu_lora.available.__wrapped__(torch.float32),
    ),
    "fused": (
        lambda: UNCACHED_KERNELS[cpu_fused](torch.float32),
        lambda: cpu_fused.available.__wrapped__(torch.float32),
    ),
    "sampling": (lambda: sampler.get_sampler("cpu", "cpu"), sampler._cpu_available),
    "token-bitmask": (token_bitmask.build, lambda: token_bitmask._entry.__wrapped__() is not None),
}


@pytest.mark.parametrize("kernel", KERNEL_LOADS)
def test_a_failing_compiler_fails_the_kernel_tests_and_no_compiler_skips_them(
    kernel: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A compiler that runs and exits 1 is a CompileError carrying its stderr, which `c_kernel_or_skip` (what the
    kernel tests call) lets through: the test fails, it does not skip. No compiler at all is the one skip, with
    the reason. At run time either one still makes `auto` fall back to torch (the check answers False)."""
    load, runtime_check = KERNEL_LOADS[kernel]
    # Each `available` asks its module's `kernels`, cached per process: an earlier test may have loaded the real
    # library already, so the check would answer from that cache. Ask the uncached loader here.
    for module, uncached in UNCACHED_KERNELS.items():
        monkeypatch.setattr(module, "kernels", uncached)
    script = tmp_path / "fakecc"
    script.write_text("#!/bin/sh\necho 'fakecc: error: this kernel does not compile' >&2\nexit 1\n")
    script.chmod(0o755)
    monkeypatch.setenv(
        "PAGODA_KERNEL_CACHE", str(tmp_path / "cache")
    )  # empty and private: nothing cached is reused
    monkeypatch.setenv("CC", str(script))
    error = _raised(load)
    assert isinstance(error, cbuild.CompileError), repr(error)
    assert "fakecc: error: this kernel does not compile" in str(error)
    assert error.returncode == 1 and "this kernel does not compile" in error.stderr
    assert error.command[0] == str(script)
    with caplog.at_level(logging.WARNING):
        assert not runtime_check()
    assert "this kernel does not compile" in caplog.text
    monkeypatch.setenv("CC", "no-such-compiler")
    skip = _raised(load)
    assert isinstance(skip, unittest.SkipTest) and "found no C compiler" in str(skip), repr(skip)
    assert not runtime_check()


def _raised(load: Callable[[], object]) -> BaseException:
    """What c_kernel_or_skip(load) raised, a skip included (pytest.raises would let a skip end the test as
    skipped, so a helper that skips on a failing compiler would pass it quietly)."""
    try:
        c_kernel_or_skip(load)
    except BaseException as exc:  # the skip too: it is what is looked at
        return exc
    pytest.fail("the C kernel loaded without a working compiler")


def test_the_compile_error_survives_pickling() -> None:
    """A CompileError keeps its fields across processes (an engine core's start-up error travels to the server)."""
    error = cbuild.CompileError("it failed", ["cc", "x.c"], 3, "x.c:1: error")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is cbuild.CompileError and str(again) == "it failed"
    assert (again.command, again.returncode, again.stderr) == (("cc", "x.c"), 3, "x.c:1: error")
    assert isinstance(again, BackendUnavailableError)


def test_editing_an_included_header_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A source read through csrc.read_source carries its local headers, so editing one gives a new library."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path / "cache"))
    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "answer.c").write_text('#include "answer.h"\n' + SOURCE)
    (sources / "answer.h").write_text("#define ANSWER 42\n")
    first = _build(("-O2",), source=csrc.read_source("answer.c", sources))
    assert _answer(first) == 42
    (sources / "answer.h").write_text("#define ANSWER 7\n")
    second = _build(("-O2",), source=csrc.read_source("answer.c", sources))
    assert second != first and _answer(second) == 7


def test_the_c_kernels_share_one_dtype_header() -> None:
    """The dtype loaders are defined in cpu_dtype.h alone, and both C kernels that load tensors inline it."""
    folder = Path(csrc.__file__).parent
    header = (folder / "cpu_dtype.h").read_text()
    definitions = ("typedef float scalar_t;", "static inline float load1(", "static inline scalar_t store1(")
    assert all(definition in header for definition in definitions)
    for path in folder.glob("*.c"):
        assert not any(definition in path.read_text() for definition in definitions), path.name
    for name in ("cpu_attention.c", "cpu_sampling.c"):
        text = csrc.read_source(name)
        assert header in text and '#include "' not in text, name
