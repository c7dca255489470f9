"""A stub child program for the process-stack tests: `python -m procs_stub` (tests/server on PYTHONPATH).

It writes the `ChildSpec` it decoded to `spec.report` (msgspec JSON), then behaves as `spec.mode` says: "exit"
returns at once, "sleep" sleeps, "ignore_sigterm" ignores SIGTERM and sleeps; a sleeping stub writes its pid to
`spec.report` + ".ready" first, so the test knows the signal disposition is in place.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import msgspec
from pagoda.server.procs import ChildSpec, Program
from pagoda.server.procs.child import run_process


class StubSpec(msgspec.Struct, frozen=True):
    """What the stub does, and where it reports."""

    mode: str
    report: str
    payload: list[int] = []


def _run(child: ChildSpec[StubSpec]) -> None:
    """The stub's body."""
    Path(child.spec.report).write_bytes(msgspec.json.encode(child))
    if child.spec.mode == "exit":
        return
    if child.spec.mode == "ignore_sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(child.spec.report + ".ready").write_text(str(os.getpid()))
    while True:
        time.sleep(1.0)


STUB_PROGRAM = Program("stub", "procs_stub", StubSpec, _run)

if __name__ == "__main__":
    run_process(STUB_PROGRAM)
