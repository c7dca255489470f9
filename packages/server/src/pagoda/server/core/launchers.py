"""Where engine cores run: local processes (spawned interpreters), or Ray actors; both connect to the front end.

A launcher starts core `index` of a replica set against two addresses the front end bound, and returns a handle
the front end polls for liveness and kills on shutdown.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import msgspec
from pagoda.server.core.engine_core import CoreSpec

logger = logging.getLogger(__name__)


class CoreHandle(Protocol):
    """A started engine core as its launcher sees it."""

    def is_alive(self) -> bool:
        """False once the core exited or was killed."""
        ...

    def describe_exit(self) -> str:
        """How the core ended, for logs and error messages."""
        ...

    def kill(self) -> None:
        """Kill the core now (SIGKILL or ray.kill)."""
        ...

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the core to exit; True if it did."""
        ...


class CoreLauncher(Protocol):
    """Starts engine cores and names the addresses their sockets connect to."""

    def address(self, index: int, generation: int, channel: str) -> str:
        """The ZeroMQ address the front end binds for core `index`'s `channel` ("input" or "output")."""
        ...

    def launch(self, index: int, spec: CoreSpec) -> CoreHandle:
        """Start core `index` (returns at once; the core announces itself with `Ready`)."""
        ...

    def close(self) -> None:
        """Release what the launcher holds (socket folders)."""
        ...


def replica_cpus(index: int, num_replicas: int) -> tuple[int, ...] | None:
    """The cores replica `index` is pinned to (and runs as many torch threads on), or None (no pinning).

    With more cores than replicas, the first core is left to the front end (HTTP, JSON, tokenizer, the router's
    thread) and the rest are split evenly: a core process whose OpenMP threads share cores with a busy front end
    waits on its own barriers (measured on 2 cores: 2 threads beside the front end made a step 5x slower than
    1 thread). With exactly one core per replica each replica gets one (the front end shares them all); with
    fewer cores than replicas nothing is pinned and the replicas share every core.
    """
    available = sorted(os.sched_getaffinity(0))
    if len(available) < num_replicas:
        return None
    if len(available) > num_replicas:
        available = available[1:]
    per_replica = len(available) // num_replicas
    return tuple(available[index * per_replica : (index + 1) * per_replica])


class _ProcessHandle:
    """A core subprocess."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process

    def is_alive(self) -> bool:
        """True while the process runs (polling reaps it once it exited)."""
        return self._process.poll() is None

    def describe_exit(self) -> str:
        """The exit code, or the signal that killed it."""
        code = self._process.poll()
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

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

    @property
    def pid(self) -> int:
        """The process id."""
        return self._process.pid


class ProcessLauncher:
    """Cores as local processes talking over ipc://.

    Spawned, not forked: a fresh interpreter (`python -m pagoda.server.core`) with no copy of the front end's
    torch threads or sockets; its `CoreSpec` arrives msgpack-encoded on stdin (no pickle anywhere).
    """

    def __init__(self, num_replicas: int, log_level: int, pin: bool = True) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="pagoda-core-"))
        self._num_replicas = num_replicas
        self._log_level = log_level
        self._pin = pin

    def address(self, index: int, generation: int, channel: str) -> str:
        """An ipc path in the launcher's private folder."""
        return f"ipc://{self._folder}/core{index}-{generation}-{channel}"

    def launch(self, index: int, spec: CoreSpec) -> CoreHandle:
        """Start the core process (a core may start tensor-parallel workers of its own)."""
        cpus = replica_cpus(index, self._num_replicas) if self._pin else None
        spec = CoreSpec(spec.config_frame, spec.input_address, spec.output_address, os.getpid(), cpus)
        command = [sys.executable, "-m", "pagoda.server.core", "--log-level", str(self._log_level)]
        process = subprocess.Popen(command, stdin=subprocess.PIPE)
        assert process.stdin is not None
        process.stdin.write(msgspec.msgpack.encode(spec))
        process.stdin.close()
        logger.info("engine core %d: pid %d, cpus %s", index, process.pid, "all" if cpus is None else cpus)
        return _ProcessHandle(process)

    def close(self) -> None:
        """Remove the socket folder."""
        for path in self._folder.iterdir():
            path.unlink(missing_ok=True)
        self._folder.rmdir()


def kill_all(handles: Sequence[CoreHandle], timeout: float) -> None:
    """Wait up to `timeout` seconds for every core to exit, then kill the rest."""
    for handle in handles:
        if not handle.join(timeout):
            logger.warning("an engine core did not exit in %.0f s; killing it", timeout)
            handle.kill()
            handle.join(5.0)
