"""The launcher seam: where child processes (engine cores, tensor-parallel workers) run, and how they stop.

A `Launcher` starts one child of a `Program` per `launch` and returns its `Handle`; whoever launched it owns the
handle (polls it, kills it). The launcher itself owns only what its children share: the folder of their ipc
sockets, the placement group they run in. `ProcessLauncher` (procs/local.py) runs children as fresh local
interpreters, `RayLauncher` (procs/ray_launcher.py) as Ray actors; `stop_children` is the one way to stop them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol, TypeVar

import zmq
from pagoda.server.procs.spec import Program

logger = logging.getLogger(__name__)

S = TypeVar("S")


class Handle(Protocol):
    """A started child as its launcher sees it."""

    def describe(self) -> str:
        """Its name and where it runs, e.g. "engine core 0 (pid 4242)", for logs and error messages."""
        ...

    def is_alive(self) -> bool:
        """False once the child exited or was killed."""
        ...

    def describe_exit(self) -> str:
        """How the child ended ("exited with -9 (SIGKILL)", "failed: RayActorError: ..."), or "still running"."""
        ...

    def kill(self) -> None:
        """Kill the child now (SIGKILL, or ray.kill); harmless once it ended."""
        ...

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the child to exit; True if it did."""
        ...


class Launcher(Protocol):
    """Starts children of any `Program` and names the addresses they reach their parent at."""

    def host(self) -> str:
        """This process's address as the children see it (loopback locally, the node's IP under Ray)."""
        ...

    def address(self, name: str) -> str:
        """A ZeroMQ address for the parent to bind, named `name` (ipc:// locally, tcp://host:0 under Ray)."""
        ...

    def launch(self, program: Program[S], spec: S, *, index: int, name: str) -> Handle:
        """Start child `index` of this launcher's set (returns at once; the child announces itself with `Ready`)."""
        ...

    def close(self) -> None:
        """Release what the children shared (socket folder, placement group); their handles were stopped first."""
        ...


def stop_children(handles: Sequence[Handle], timeout: float) -> None:
    """Wait up to `timeout` seconds in all for children told to stop (`Shutdown`), then kill the stragglers.

    A timeout of 0 kills at once: after a failure the survivors may sit in a collective that never completes.
    """
    deadline = time.monotonic() + timeout
    for handle in handles:
        if handle.join(max(0.0, deadline - time.monotonic())):
            continue
        if timeout > 0:
            logger.warning("%s did not exit in %.0f s; killing it", handle.describe(), timeout)
        handle.kill()
        handle.join(5.0)  # reap it: no zombie left behind


def bind(socket: zmq.Socket[bytes], address: str) -> str:
    """Bind `address` (a launcher's); a tcp address with port 0 binds a free port. Returns the address bound."""
    if address.startswith("tcp://") and address.endswith(":0"):
        port = socket.bind_to_random_port(address.removesuffix(":0"))
        return f"{address.removesuffix(':0')}:{port}"
    socket.bind(address)
    return address


def local_path(launcher: Launcher, name: str) -> str | None:
    """A file path in the launcher's private folder when its children are local (ipc://), else None."""
    address = launcher.address(name)
    return address.removeprefix("ipc://") if address.startswith("ipc://") else None
