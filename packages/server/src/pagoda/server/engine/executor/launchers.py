"""Where the workers of ranks 1..N-1 run: local processes (`mp`) or Ray actors in a placement group (`ray`)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Protocol

import msgspec
from pagoda.server.engine.executor.messages import WorkerSpec


class Launcher(Protocol):
    """Starts, watches and stops the workers; knows the address they reach the driver at."""

    def host(self) -> str:
        """The driver's address as the workers see it."""
        ...

    def start(self, specs: Sequence[WorkerSpec]) -> None:
        """Start one worker per spec (ranks 1..N-1, in order)."""
        ...

    def failure(self) -> str | None:
        """A description of the first worker that ended, or None while all run."""
        ...

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the workers to exit (they were told to), then kill the rest."""
        ...

    def kill(self) -> None:
        """Kill every worker still running (idempotent; the engine's finalizer calls it)."""
        ...


class ProcessLauncher:
    """Each worker a fresh interpreter on this machine (spawn semantics: nothing inherited but the environment).

    Started with subprocess rather than multiprocessing so that an engine inside a daemonic process (an
    engine-core process) can still start its workers; each worker exits when this process is gone.
    """

    def __init__(self) -> None:
        self._processes: list[tuple[int, subprocess.Popen[bytes]]] = []

    def host(self) -> str:
        """Loopback: every rank is local."""
        return "127.0.0.1"

    def start(self, specs: Sequence[WorkerSpec]) -> None:
        """Spawn `python -m pagoda.server.engine.executor.worker <spec>` per rank."""
        module = "pagoda.server.engine.executor.worker"
        for spec in specs:
            argv = [sys.executable, "-m", module, msgspec.json.encode(spec).decode()]
            self._processes.append((spec.rank, subprocess.Popen(argv, stdin=subprocess.DEVNULL)))

    def failure(self) -> str | None:
        """The first worker that exited, with its status (a negative status is the signal that killed it)."""
        for rank, process in self._processes:
            if process.poll() is not None:
                return (
                    f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with {process.returncode}"
                )
        return None

    def pids(self) -> list[int]:
        """The workers' process ids, rank order."""
        return [process.pid for _, process in self._processes]

    def stop(self, timeout: float) -> None:
        """Wait for the workers to exit, then kill the stragglers."""
        deadline = time.monotonic() + timeout
        for _, process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """SIGKILL whatever still runs, and reap it."""
        for _, process in self._processes:
            if process.poll() is None:
                process.kill()
                process.wait()
