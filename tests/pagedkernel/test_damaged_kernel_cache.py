"""A damaged kernel cache (issue 43, finding 13): every C library (attention, fused, LoRA, quant, sampling, token
bitmask, the native decode layers, the fused LM head) loads through `cbuild.load_or_rebuild`: a truncated cached
`.so` is deleted and compiled again; when the rebuild fails too, the library's torch path runs, with a warning. A
kernel that does not compile still fails the kernel tests (`c_kernel_or_skip`), never turns into a skip."""

from __future__ import annotations

import logging
import os
import unittest
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from pagoda.pagedkernel import cbuild, cpu_backend
from pagoda.pagedkernel.backend import BackendUnavailableError
from pagoda.pagedkernel.cpu_backend import CpuBackend
from pagoda.pagedkernel.decode import cpu_decode
from pagoda.pagedkernel.fused import cpu_fused
from pagoda.pagedkernel.lora import cpu_lora
from pagoda.pagedkernel.quant import cpu_quant
from pagoda.pagedkernel.sampling import cpu_sampling, fused_head, token_bitmask, torch_sampling
from pagoda.pagedkernel.sampling.sampler import get_sampler
from pagoda.pagedkernel.testing import c_kernel_or_skip


@dataclass(frozen=True, slots=True)
class Library:
    """One C library: its cached file, and whether its public entry runs C (after `forget`) or its torch path."""

    name: str
    build: Callable[[], Path]
    runs_c: Callable[[], bool]
    forget: Callable[[], None]  # clears the per-process caches of what was loaded


def _forget_fused() -> None:
    cpu_fused.kernels.cache_clear()
    cpu_fused.available.cache_clear()


def _forget_lora() -> None:
    cpu_lora.kernels.cache_clear()
    cpu_lora.available.cache_clear()


def _forget_quant() -> None:
    cpu_quant.kernels.cache_clear()
    cpu_quant.available.cache_clear()


def _forget_decode() -> None:
    cpu_decode.kernels.cache_clear()
    cpu_decode.available.cache_clear()


def _forget_fused_head() -> None:
    fused_head.kernels.cache_clear()
    fused_head.available.cache_clear()


def _nothing() -> None:
    """The cpu attention backend keeps its libraries per instance: a new one forgets."""


LIBRARIES = (
    Library(
        "attention",
        lambda: cpu_backend.build(torch.float32),
        lambda: CpuBackend().kernels(torch.float32) is not None,
        _nothing,
    ),
    Library(
        "fused",
        lambda: cpu_fused.build(torch.float32),
        lambda: cpu_fused.available(torch.float32),
        _forget_fused,
    ),
    Library(
        "lora", lambda: cpu_lora.build(torch.float32), lambda: cpu_lora.available(torch.float32), _forget_lora
    ),
    Library("quant", cpu_quant.build, cpu_quant.available, _forget_quant),
    Library(
        "sampling",
        lambda: cpu_sampling.build(torch.float32),
        cpu_sampling.available,
        cpu_sampling._entry.cache_clear,
    ),
    Library(
        "bitmask", token_bitmask.build, token_bitmask.c_kernel_available, token_bitmask._entry.cache_clear
    ),
    Library(
        "decode",
        lambda: cpu_decode.build(torch.float32),
        lambda: cpu_decode.available(torch.float32),
        _forget_decode,
    ),
    Library("fused_head", fused_head.build, fused_head.available, _forget_fused_head),
)


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each library compiled once for the module (each test copies it into its own cache, then damages it)."""
    folder = tmp_path_factory.mktemp("warm")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGODA_KERNEL_CACHE", str(folder))
        return {lib.name: lib.build() for lib in LIBRARIES}


@pytest.fixture(params=LIBRARIES, ids=[lib.name for lib in LIBRARIES])
def library(
    request: pytest.FixtureRequest, warm: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Library]:
    """One library whose whole `.so` sits in a fresh private cache, with nothing of it loaded in this process
    before or after."""
    lib: Library = request.param
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    (tmp_path / warm[lib.name].name).write_bytes(warm[lib.name].read_bytes())
    assert lib.build() == tmp_path / warm[lib.name].name  # found in the cache, not compiled
    lib.forget()
    yield lib
    lib.forget()


def _truncate(path: Path, size: int) -> None:
    """Replace the file by its first `size` bytes (a half library keeps its ELF headers: dlopen alone would map it,
    then SIGBUS). A new file renamed over the path, never the same file cut in place: a library this process has
    loaded keeps its mapping of the old file, which truncating would turn into a SIGBUS at the next touch (at the
    latest when the process exits and runs the library's finalizers)."""
    damaged = path.with_name(path.name + ".damaged")
    damaged.write_bytes(path.read_bytes()[:size])
    os.replace(damaged, path)


def test_a_truncated_library_is_rebuilt_and_loads(library: Library, caplog: pytest.LogCaptureFixture) -> None:
    """The cached `.so` cut to half is deleted, compiled again and loaded: the C path runs."""
    path = library.build()
    whole = path.read_bytes()
    _truncate(path, len(whole) // 2)
    with caplog.at_level(logging.WARNING):
        assert library.runs_c()
    assert "compiling it again" in caplog.text and str(path) in caplog.text
    assert path.stat().st_size == len(whole)  # a whole library again, in the cache


@pytest.mark.parametrize(
    "error",
    [
        cbuild.CompileError("cc: internal compiler error", ["cc"], 4, "cc: internal compiler error"),
        cbuild.CompilerNotFoundError("found no C compiler"),
    ],
    ids=["compile-error", "no-compiler"],
)
def test_a_rebuild_that_fails_falls_back_to_torch_with_a_warning(
    library: Library,
    error: BackendUnavailableError,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Truncated, and the rebuild raises: the library's torch path runs, with a warning naming the library."""
    path = library.build()
    _truncate(path, path.stat().st_size // 2)

    def refuse(*args: object) -> Path:
        raise error

    monkeypatch.setattr(cbuild, "_compile", refuse)
    with caplog.at_level(logging.WARNING):
        assert not library.runs_c()
    assert "did not mend it" in caplog.text and str(path) in caplog.text and str(error) in caplog.text


def test_an_empty_library_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached `.so` cut to nothing (dlopen: "file too short") is compiled again too."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    path = token_bitmask.build()
    size = path.stat().st_size
    _truncate(path, 0)
    token_bitmask._entry.cache_clear()
    try:
        assert token_bitmask.c_kernel_available() and path.stat().st_size == size
    finally:
        token_bitmask._entry.cache_clear()


def test_a_kernel_test_still_fails_on_a_compile_error_in_the_rebuild(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`c_kernel_or_skip` over a damaged cache whose rebuild does not compile raises (a failure), never skips; the
    first build's CompileError is still itself."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    _forget_fused()
    path = cpu_fused.build(torch.float32)
    _truncate(path, 100)
    error = cbuild.CompileError("cc refused it", ["cc"], 1, "error: no")

    def refuse(*args: object) -> Path:
        raise error

    monkeypatch.setattr(cbuild, "_compile", refuse)
    try:
        with pytest.raises(cbuild.DamagedLibraryError) as damaged:
            c_kernel_or_skip(lambda: cpu_fused.kernels(torch.float32))
        assert damaged.value.__cause__ is error and not isinstance(damaged.value, unittest.SkipTest)
        with pytest.raises(cbuild.CompileError):  # no cached file now: the first build's own error
            c_kernel_or_skip(lambda: cpu_fused.kernels(torch.bfloat16))
    finally:
        _forget_fused()


def test_the_auto_sampler_over_a_damaged_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """get_sampler('auto') on the CPU: the C sampler when the rebuild mends the cache, else torch; a dtype whose
    library fails at the first step is sampled by torch, with the specification's tokens."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    cpu_sampling._entry.cache_clear()
    try:
        path, bf16 = cpu_sampling.build(torch.float32), cpu_sampling.build(torch.bfloat16)
        _truncate(path, path.stat().st_size // 2)
        assert get_sampler("auto", "cpu").name == "cpu"
        cpu_sampling._entry.cache_clear()
        for damaged in (path, bf16):
            _truncate(damaged, damaged.stat().st_size // 2)
        monkeypatch.setattr(cbuild, "_compile", _refuse)
        assert get_sampler("auto", "cpu").name == "torch"
        # the bfloat16 library, damaged beyond repair, at the first step: torch samples those logits
        logits = torch.randn(3, 50).to(torch.bfloat16)
        args = (
            torch.tensor([1.0, 0.0, 2.0]),
            torch.tensor([0, 0, 5]),
            torch.tensor([0.9, 1.0, 1.0]),
            torch.zeros(3),
            torch.tensor([1, 2, 3]),
        )
        ours = cpu_sampling.run(logits, *args, with_mask=True)
        spec = torch_sampling.run(logits, *args, with_mask=True)
        assert all(
            torch.equal(a, b) for a, b in zip(ours, spec, strict=True) if a is not None and b is not None
        )
    finally:
        cpu_sampling._entry.cache_clear()


def _refuse(*args: object) -> Path:
    raise cbuild.CompileError("cc is gone", ["cc"], 127, "")


def test_check_whole_refuses_every_cut(warm: dict[str, Path], tmp_path: Path) -> None:
    """Each whole library passes `check_whole`; cut anywhere past its first bytes (within its headers, its code,
    its section table) it is refused before dlopen could map it."""
    for library in warm.values():
        cbuild.check_whole(library)
        data, cut = library.read_bytes(), tmp_path / library.name
        for size in (10, 64, 100, len(data) // 3, len(data) // 2, len(data) - 200):
            cut.write_bytes(data[:size])
            with pytest.raises(OSError, match="truncated"):
                cbuild.check_whole(cut)
