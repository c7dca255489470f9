"""Children as local processes: a fresh interpreter each (`python -m <program.module>`), its spec on stdin."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TypeVar

from pagoda.server.procs.launch import Handle
from pagoda.server.procs.spec import ChildSpec, Program, encode_child

logger = logging.getLogger(__name__)

S = TypeVar("S")


CHILD_INDEX_ENV = "PAGODA_CHILD_INDEX"


def pinned_cpus(index: int, count: int) -> tuple[int, ...] | None:
    """The cores child `index` of `count` is pinned to (and runs as many torch threads on), or None (no pinning).

    With more cores than children, the first core is left to the parent (for engine cores: HTTP, JSON, tokenizer,
    the router's thread) and the rest are split evenly: a child whose OpenMP threads share cores with a busy
    parent waits on its own barriers (measured on 2 cores: 2 threads beside the front end made a step 5x slower
    than 1 thread). With exactly one core per child each child gets one (the parent shares them all); with fewer
    cores than children nothing is pinned and the children share every core.
    """
    available = sorted(os.sched_getaffinity(0))
    if len(available) < count:
        return None
    if len(available) > count:
        available = available[1:]
    per_child = len(available) // count
    return tuple(available[index * per_child : (index + 1) * per_child])


class ProcessHandle:
    """A child subprocess."""

    def __init__(self, process: subprocess.Popen[bytes], name: str) -> None:
        self._process = process
        self._name = name

    @property
    def pid(self) -> int:
        """The process id."""
        return self._process.pid

    def describe(self) -> str:
        """The child's name and pid."""
        return f"{self._name} (pid {self._process.pid})"

    def is_alive(self) -> bool:
        """True while the process runs (polling reaps it once it exited)."""
        return self._process.poll() is None

    def describe_exit(self) -> str:
        """The exit status, and the signal's name when a signal ended it (a negative status)."""
        code = self._process.poll()
        if code is None:
            return "still running"
        if code < 0 and -code in signal.valid_signals():
            return f"exited with {code} ({signal.Signals(-code).name})"
        return f"exited with {code}"

    def kill(self) -> None:
        """SIGKILL the process."""
        if self._process.poll() is None:
            self._process.kill()

    def join(self, timeout: float) -> bool:
        """Wait for the process to exit."""
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


class ProcessLauncher:
    """Children as local processes, `count` of them at most at a time, talking over ipc:// (or loopback tcp).

    Spawned, not forked: a fresh interpreter with no copy of the parent's torch threads or sockets, started with
    subprocess rather than multiprocessing so that a child (an engine core) can start children of its own (its
    tensor-parallel workers). Each child exits once this process is gone (its watchdog) and, when `pin`, runs on
    cores of its own: the `cpus` listed for its index (`--replica-cpus`), else `pinned_cpus`.
    """

    def __init__(
        self, count: int, log_level: int, pin: bool = True, cpus: tuple[tuple[int, ...], ...] | None = None
    ) -> None:
        self._count = count
        self._log_level = log_level
        self._pin = pin
        self._cpus = cpus  # per child index, its CPUs as the user listed them (None: `pinned_cpus`)
        self._folder: Path | None = None  # created by the first `address`

    def host(self) -> str:
        """Loopback: every child is local."""
        return "127.0.0.1"

    def address(self, name: str) -> str:
        """An ipc path in the launcher's private folder."""
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="pagoda-procs-"))
        return f"ipc://{self._folder}/{name}"

    def launch(self, program: Program[S], spec: S, *, index: int, name: str) -> Handle:
        """Start `python -m program.module` and write its `ChildSpec` to its stdin."""
        # By index, so a restarted child runs where its predecessor did.
        if self._cpus is not None:
            cpus: tuple[int, ...] | None = self._cpus[index]
        else:
            cpus = pinned_cpus(index, self._count) if self._pin else None
        child = ChildSpec(spec, self._log_level, own_process=True, parent_pid=os.getpid(), cpus=cpus)
        # The index in its environment: `ps e` and process tools tell a set's children apart (same command line).
        env = {**os.environ, CHILD_INDEX_ENV: str(index)}
        process = subprocess.Popen([sys.executable, "-m", program.module], stdin=subprocess.PIPE, env=env)
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # a child that died at once shows as exited
            process.stdin.write(encode_child(child))
        with contextlib.suppress(BrokenPipeError):
            process.stdin.close()
        logger.info("%s: pid %d, cpus %s", name, process.pid, "all" if cpus is None else cpus)
        return ProcessHandle(process, name)

    def close(self) -> None:
        """Remove the socket folder."""
        if self._folder is None:
            return
        for path in self._folder.iterdir():
            path.unlink(missing_ok=True)
        self._folder.rmdir()
        self._folder = None
