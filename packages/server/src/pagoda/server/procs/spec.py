"""What a launcher starts (`Program`) and the one frame it hands the child (`ChildSpec`), msgpack both ways.

A local child reads its `ChildSpec` from stdin, a Ray actor gets it as its one argument: the same msgpack bytes
either way, decoded against the program's own spec type, so a spec is never pickled and a frame that is not
exactly a `ChildSpec` of that type fails to decode (`msgspec.ValidationError`) before the child does anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec

S = TypeVar("S")


class ChildSpec(msgspec.Struct, Generic[S], frozen=True):
    """The program's spec and what the process around it needs: log level, watchdog, CPU pinning."""

    spec: S
    log_level: int
    own_process: bool  # a process of its own (it handles SIGTERM, ignores SIGINT); False in a Ray actor
    parent_pid: int | None = None  # exit once this process is gone (local children); None: Ray decides
    cpus: tuple[int, ...] | None = None  # pin the process to these cores (and as many torch threads)


@dataclass(frozen=True, slots=True)
class Program(Generic[S]):
    """A child program: the module a local process runs, its spec type, and its body (process or Ray actor).

    `module`'s `python -m` entry calls `pagoda.server.procs.child.run_process` with this program; a Ray actor
    calls `run` itself. `run` returns when the child was told to stop, and raises when it failed.
    """

    name: str  # for logs: "core", "worker"
    module: str
    spec_type: type[S]
    run: Callable[[ChildSpec[S]], None]


def encode_child(child: ChildSpec[S]) -> bytes:
    """The frame a launcher hands a child."""
    return msgspec.msgpack.encode(child)


def decode_child(frame: bytes, program: Program[S]) -> ChildSpec[S]:
    """The child's side: its `ChildSpec`, typed by its program (raises on anything else)."""
    return msgspec.msgpack.decode(frame, type=ChildSpec[program.spec_type])  # type: ignore[name-defined]
