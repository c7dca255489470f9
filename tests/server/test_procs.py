"""The process stack (pagoda.server.procs) with a stub child: spec transport, stop-then-kill, watchdog, frames.

The engine-core and tensor-parallel tests prove the same launchers with real engines (and Ray); these prove the
shared pieces alone, in seconds.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import psutil
import pytest
from pagoda.server.core.messages import EngineInfo
from pagoda.server.procs import (
    ChildSpec,
    FrameDecoder,
    Handle,
    ProcessHandle,
    ProcessLauncher,
    Ready,
    Shutdown,
    stop_children,
)
from pagoda.server.procs.spec import decode_child, encode_child
from procs_stub import STUB_PROGRAM, StubSpec

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "packages" / "server" / "src" / "pagoda" / "server"


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[ProcessLauncher]:
    """A launcher of unpinned stub children (the stub module importable by the child)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    launched = ProcessLauncher(1, logging.INFO, pin=False)
    yield launched
    launched.close()


def wait_for(path: Path, seconds: float = 60.0) -> None:
    """Wait until the child wrote `path` (a fresh interpreter takes a moment on a busy machine)."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_spec_round_trips_through_stdin(launcher: ProcessLauncher, tmp_path: Path) -> None:
    """The child decodes exactly the spec it was given, with its parent's pid and no pinning; exits 0."""
    spec = StubSpec("exit", str(tmp_path / "report"), payload=list(range(40000)))  # > a pipe buffer (64 KiB)
    handle = launcher.launch(STUB_PROGRAM, spec, index=0, name="stub 0")
    assert handle.join(60.0)
    assert handle.describe_exit() == "exited with 0"
    assert re.fullmatch(r"stub 0 \(pid \d+\)", handle.describe())
    got = msgspec.json.decode((tmp_path / "report").read_bytes(), type=ChildSpec[StubSpec])
    assert got == ChildSpec(spec, logging.INFO, own_process=True, parent_pid=os.getpid(), cpus=None)


def test_child_spec_frame_is_typed() -> None:
    """A frame decodes only as a `ChildSpec` of the program's own spec type: anything else raises."""
    spec = StubSpec("exit", "/nowhere")
    frame = encode_child(ChildSpec(spec, logging.INFO, own_process=False))
    assert decode_child(frame, STUB_PROGRAM).spec == spec
    for bad in (
        b"",
        b"\xc1",
        msgspec.msgpack.encode({"spec": {"mode": "exit"}, "log_level": 20, "own_process": True}),
        msgspec.msgpack.encode({"spec": {"mode": 1, "report": "x"}, "log_level": 20, "own_process": True}),
        encode_child(ChildSpec(EngineInfo("m", "/t", 1, 2, 3, 4), logging.INFO, own_process=True)),
    ):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            decode_child(bad, STUB_PROGRAM)


@pytest.mark.timeout(120)
def test_stop_children_kills_a_child_that_ignores_sigterm(
    launcher: ProcessLauncher, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A child that ignores SIGTERM is waited for the whole timeout, then SIGKILLed and reaped, with a warning."""
    report = tmp_path / "report"
    handle = launcher.launch(STUB_PROGRAM, StubSpec("ignore_sigterm", str(report)), index=0, name="stub 0")
    wait_for(Path(f"{report}.ready"))
    assert isinstance(handle, ProcessHandle)
    os.kill(handle.pid, signal.SIGTERM)
    assert not handle.join(0.5) and handle.is_alive()  # ignored
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        stop_children([handle], timeout=1.0)
    assert time.monotonic() - started >= 1.0
    assert not handle.is_alive() and handle.describe_exit() == "exited with -9 (SIGKILL)"
    assert "stub 0 (pid" in caplog.text and "did not exit in 1 s; killing it" in caplog.text
    with pytest.raises(ProcessLookupError):
        os.kill(handle.pid, 0)  # reaped: no zombie left


@pytest.mark.timeout(120)
def test_stop_children_with_no_timeout_kills_at_once(
    launcher: ProcessLauncher, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Timeout 0 (after a failure): every child is killed without waiting, quietly; exited ones are left be."""
    handles: list[Handle] = []
    for index, mode in enumerate(("sleep", "sleep", "exit")):
        report = tmp_path / f"report{index}"
        handles.append(
            launcher.launch(STUB_PROGRAM, StubSpec(mode, str(report)), index=0, name=f"stub {index}")
        )
        wait_for(Path(f"{report}.ready") if mode == "sleep" else report)
    assert handles[2].join(60.0)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        stop_children(handles, timeout=0.0)
    assert time.monotonic() - started < 5.0
    assert [h.describe_exit() for h in handles] == ["exited with -9 (SIGKILL)"] * 2 + ["exited with 0"]
    assert "killing" not in caplog.text


@pytest.mark.timeout(120)
def test_child_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    """The watchdog: a child whose parent was SIGKILLed (re-parented) exits by itself within seconds."""
    report = tmp_path / "report"
    parent_code = textwrap.dedent(
        f"""
        import logging, time
        from pagoda.server.procs import ProcessLauncher
        from procs_stub import STUB_PROGRAM, StubSpec
        launcher = ProcessLauncher(1, logging.INFO, pin=False)
        launcher.launch(STUB_PROGRAM, StubSpec("ignore_sigterm", {str(report)!r}), index=0, name="stub")
        time.sleep(600)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=env)
    try:
        wait_for(Path(f"{report}.ready"))
        child = psutil.Process(int(Path(f"{report}.ready").read_text()))
        assert child.ppid() == parent.pid
        parent.kill()
        parent.wait()
        child.wait(timeout=30)  # psutil.TimeoutExpired if the child outlived its parent
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1garbage",
        msgspec.msgpack.encode({"type": "Ready", "pid": 1}),  # no info
        msgspec.msgpack.encode({"type": "Ready", "info": "rank one", "pid": 1}),  # info of the wrong type
        msgspec.msgpack.encode({"type": "Started", "info": 1, "pid": 1}),  # unknown tag
        msgspec.msgpack.encode({"info": 1, "pid": 1}),  # untagged
    ],
)
def test_malformed_control_frames_are_rejected(frame: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """A control frame that is not exactly a `Ready` of the channel's info type, or a `Shutdown`, is dropped."""
    decoder = FrameDecoder(Ready[int] | Shutdown, "test control")  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        assert decoder.decode_or_none(frame) is None
    assert "dropped a malformed test control frame" in caplog.text


def test_control_frames_round_trip() -> None:
    """`Ready` carries any info type, `Shutdown` nothing; both decode as themselves from their tags."""
    decoder: FrameDecoder[Ready[int] | Shutdown] = FrameDecoder(Ready[int] | Shutdown, "test")  # type: ignore[arg-type]
    assert decoder.decode_or_none(msgspec.msgpack.encode(Ready(info=3, pid=42, token="t"))) == Ready(
        info=3, pid=42, token="t"
    )
    assert decoder.decode_or_none(msgspec.msgpack.encode(Shutdown())) == Shutdown()


def test_one_process_stack_in_the_tree() -> None:
    """One `ProcessLauncher`, one `RayLauncher`, one `Ready`, one `Shutdown` class in the server package."""
    sources = "\n".join(path.read_text() for path in SRC.rglob("*.py"))
    for name in ("ProcessLauncher", "RayLauncher", "Ready", "Shutdown", "Failed"):
        assert len(re.findall(rf"^class {name}\b", sources, flags=re.MULTILINE)) == 1, name
