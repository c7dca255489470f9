"""Crafted .gguf files (issue 43 item 11): overflowing dimension products, offsets past the end, absurd tensor,
key/value and string counts, unknown type ids. `pagoda serve` exits 2 (bad input, like a bad flag) with one
line naming the file, never by a signal, before anything is sized by the header; a fuzz test over the header
fields holds the loader's check to one error type."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
from gguf_craft import CraftedGGUF, CraftedTensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagoda.server.cli import main
from pagoda.server.loader import GGUFFileError
from pagoda.server.loader.gguf_check import check_gguf_file

CRAFTED = {
    "dims-overflow": CraftedGGUF(tensors=[CraftedTensor(dims=(2**32, 2**32, 2**32, 2**32))]),
    "offset-past-end": CraftedGGUF(tensors=[CraftedTensor(offset=1 << 40)]),
    "tensor-count": CraftedGGUF(tensor_count=2**62),
    "kv-count": CraftedGGUF(kv_count=2**60),
    "string-length": CraftedGGUF(key_length=2**63),
    "unknown-type": CraftedGGUF(tensors=[CraftedTensor(type_id=250)]),
    "unknown-value-type": CraftedGGUF(value_type=99),
    "truncated": CraftedGGUF(data_bytes=8),
}


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A port in use, so that a server that wrongly got past its checks fails to bind instead of serving on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def _write(tmp_path: Path, crafted: CraftedGGUF, name: str = "bad.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(crafted.to_bytes())
    return path


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_serve_refuses_a_crafted_gguf_with_exit_2(
    case: str,
    tmp_path: Path,
    gguf_cache: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    busy_port: int,
) -> None:
    """`pagoda serve crafted.gguf` returns 2 within seconds, one line naming the file; nothing is converted."""
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")  # serve sets these: keep them test-local
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "256")
    path = _write(tmp_path, CRAFTED[case])
    started = time.monotonic()
    status = main(["serve", str(path), "--port", str(busy_port), "--kv-cache-gib", "0.05"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"{path} is not a valid GGUF file" in err and "Traceback" not in err
    assert time.monotonic() - started < 30
    assert not [p for p in gguf_cache.iterdir() if p.name.startswith("bad")]  # no conversion began


def test_serve_subprocess_exits_2_not_by_a_signal(tmp_path: Path, gguf_cache: Path, busy_port: int) -> None:
    """The real command line: a header declaring a 2**128-element tensor exits 2 (not killed, not 1)."""
    path = _write(tmp_path, CRAFTED["dims-overflow"])
    done = subprocess.run(
        [sys.executable, "-m", "pagoda.server.cli", "serve", str(path), "--port", str(busy_port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "is not a valid GGUF file" in done.stderr and "Traceback" not in done.stderr


_DIM = st.one_of(st.integers(0, 64), st.sampled_from([2**31, 2**32, 2**63, 2**64 - 1]))
_COUNT = st.one_of(st.none(), st.integers(0, 4), st.sampled_from([2**32, 2**62, 2**64 - 1]))
_TENSOR = st.builds(
    CraftedTensor,
    name=st.sampled_from(["token_embd.weight", "x", ""]),
    dims=st.lists(_DIM, min_size=0, max_size=6).map(tuple),
    type_id=st.one_of(st.integers(0, 45), st.sampled_from([2**31, 2**32 - 1])),
    offset=st.one_of(st.integers(0, 1024), st.sampled_from([2**40, 2**64 - 1])),
)
_HEADER = st.builds(
    CraftedGGUF,
    version=st.integers(0, 5),
    tensors=st.lists(_TENSOR, max_size=3),
    tensor_count=_COUNT,
    kv_count=_COUNT,
    key_length=_COUNT,
    value_type=st.one_of(st.integers(0, 13), st.just(2**32 - 1)),
    data_bytes=st.integers(0, 4096),
)


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=_HEADER, cut=st.one_of(st.none(), st.integers(0, 600)))
def test_fuzzed_headers_are_one_clean_error_or_a_readable_file(
    header: CraftedGGUF, cut: int | None, tmp_path: Path
) -> None:
    """Any header (optionally truncated): the check raises GGUFFileError or passes, and a file it passes is one
    gguf's own reader reads whole, every tensor's bytes inside the file."""
    data = header.to_bytes()
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(data if cut is None else data[:cut])
    try:
        check_gguf_file(path)
    except GGUFFileError:
        return
    reader = gguf.GGUFReader(str(path))
    for tensor in reader.tensors:
        assert tensor.data_offset + tensor.n_bytes <= path.stat().st_size
