"""cbuild on its own: any C source with its caller's flags, compiled once into the cache, alternatives in order.

The cpu backend's build through it (OpenMP, the pthreads fallback, the missing or failing compiler) is tested in
test_cpu_backend.py; these tests use a one-function source, as a second C kernel would bring its own. The last
ones check the C kernels' shared header: inlined by `csrc.read_source`, so the text cbuild hashes carries it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
from pagoda.pagedkernel import BackendUnavailableError, cbuild, csrc

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
