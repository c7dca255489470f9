"""The C kernel cache is private (issue 28 item 9): 0700 folders, and no library that others could have written
(a symlink, a folder or file writable by others) is ever loaded; a damaged library is rebuilt once, then the cpu
backend falls back to the torch kernels for that dtype with a warning."""

from __future__ import annotations

import ctypes
import logging
import stat
from pathlib import Path

import pytest
import torch
from pagoda.pagedkernel import cbuild, cpu_backend
from pagoda.pagedkernel.cpu_backend import CpuBackend
from pagoda.pagedkernel.testing import make_case, relative_error
from pagoda.pagedkernel.torch_backend import TorchBackend

SOURCE = "int pagoda_answer(void) { return 42; }\n"


def _build() -> Path:
    """A one-function library built through the cache (as every C kernel is)."""
    return cbuild.build("answer.c", SOURCE, ("-O1",), variant="test", owner="the test", instead="skip it")


def _answer(library: Path) -> int:
    function = ctypes.CDLL(str(library)).pagoda_answer
    function.restype = ctypes.c_int
    return int(function())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_fresh_cache_is_created_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache folder (and its missing parents) are made 0700, whatever the umask; the library 0700."""
    cache = tmp_path / "made" / "kernels"
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(cache))
    library = _build()
    assert library.parent == cache
    assert _mode(cache) == 0o700 and _mode(cache.parent) == 0o700
    assert _mode(library) & 0o022 == 0
    assert _answer(library) == 42


def test_a_world_writable_cache_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache folder anyone may write is not used: the library is built into a fresh private folder, and the
    warning names the refused folder."""
    cache = tmp_path / "open"
    cache.mkdir()
    cache.chmod(0o777)
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(cache))
    with caplog.at_level(logging.WARNING, logger="pagoda.pagedkernel.cbuild"):
        library = _build()
    assert library.parent != cache and _mode(library.parent) == 0o700
    assert list(cache.iterdir()) == []
    assert str(cache) in caplog.text and "writable by others" in caplog.text
    assert _answer(library) == 42


def test_a_symlinked_library_is_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cached name that is a symlink (to another library) is refused: a private build is made instead."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(cache))
    library = _build()
    planted = tmp_path / "planted.so"
    library.rename(planted)
    library.symlink_to(planted)
    with caplog.at_level(logging.WARNING, logger="pagoda.pagedkernel.cbuild"):
        rebuilt = _build()
    assert rebuilt != library and not rebuilt.is_symlink() and rebuilt.name == library.name
    assert str(library) in caplog.text and "symlink" in caplog.text
    assert _answer(rebuilt) == 42


def test_a_group_writable_library_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cached library that others may write is refused too (they could have replaced its code)."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    library = _build()
    library.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="pagoda.pagedkernel.cbuild"):
        rebuilt = _build()
    assert rebuilt.parent != tmp_path and str(library) in caplog.text


def test_a_corrupt_library_is_rebuilt_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cached kernel that fails to load (garbage bytes, same private mode) is deleted and compiled again."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    library = cpu_backend.build(torch.float32)
    library.write_bytes(b"\x7fELF but not really a library")
    with caplog.at_level(logging.WARNING, logger="pagoda.pagedkernel.cpu_backend"):
        kernels = CpuBackend().kernels(torch.float32)
    assert kernels is not None
    assert "failed to load" in caplog.text and str(library) in caplog.text
    assert library.stat().st_size > 1000  # a real library again, in the cache
    cpu_backend.load(library)


def test_a_library_that_never_loads_falls_back_to_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Rebuilt once and still failing to load: that dtype runs on the torch kernels, with a warning naming the
    library; attention and reshape_and_cache still give the torch backend's results."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    attempts: list[Path] = []

    def refuse(library: Path) -> cpu_backend.CpuKernels:
        attempts.append(library)
        raise OSError(f"{library}: invalid ELF header")

    monkeypatch.setattr(cpu_backend, "load", refuse)
    backend = CpuBackend()
    with caplog.at_level(logging.WARNING, logger="pagoda.pagedkernel.cpu_backend"):
        assert backend.kernels(torch.float32) is None
    assert len(attempts) == 2  # the cached one, then one rebuild
    assert "torch kernels" in caplog.text and str(attempts[-1]) in caplog.text
    assert not backend.available()
    c = make_case([(5, 5), (40, 3)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.query_start_loc, c.context_lens, c.scale)
    ours = backend.paged_prefill_attention(*args)
    assert relative_error(ours, TorchBackend().paged_prefill_attention(*args)) < 1e-6
    key = torch.randn(3, 2, 32)
    slots = torch.tensor([0, 5, 17])
    backend.reshape_and_cache(key, key, c.k_cache, c.v_cache, slots)
    assert torch.equal(c.k_cache.view(-1, 2, 32)[slots], key)
    assert len(attempts) == 2  # the refusal is remembered: no rebuild per call


def test_prepare_builds_each_dtype_up_front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`prepare` loads every dtype it is given (a float16 engine's kernels exist before its first forward)."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    backend = CpuBackend()
    assert backend.loaded_dtypes() == frozenset()
    backend.prepare([torch.float16])
    assert backend.loaded_dtypes() == {torch.float16}
    assert any("float16" in p.name for p in tmp_path.iterdir())
