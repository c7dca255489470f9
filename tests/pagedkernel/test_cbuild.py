"""cbuild on its own: any C source with its caller's flags, compiled once into the cache, alternatives in order.

The cpu backend's build through it (OpenMP, the pthreads fallback, the missing or failing compiler) is tested in
test_cpu_backend.py; these tests use a one-function source, as a second C kernel would bring its own.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
from pagoda.pagedkernel import BackendUnavailableError, cbuild

SOURCE = "int pagoda_answer(void) { return ANSWER; }\n"


def _answer(library: Path) -> int:
    """What the compiled `pagoda_answer` returns."""
    function = ctypes.CDLL(str(library)).pagoda_answer
    function.restype = ctypes.c_int
    return int(function())


def _build(flags: tuple[str, ...], alternatives: tuple[tuple[str, ...], ...] = ((),)) -> Path:
    """SOURCE built as `answer.c` with `flags` (and `alternatives`), errors worded for a test owner."""
    return cbuild.build(
        "answer.c",
        SOURCE,
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
