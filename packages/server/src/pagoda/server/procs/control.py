"""The control frames every child process and its parent exchange: `Ready`, `Shutdown`, `Failed`.

Engine cores and tensor-parallel workers speak the same three: a child sends `Ready` once it loaded its model
(`info` says what its parent needs to know of it), the parent sends `Shutdown` to make it leave its loop, and a
child that cannot go on sends `Failed` before it exits. They are msgspec Structs, msgpack-encoded and tagged, so
each channel adds its own messages beside them in one tagged union; `FrameDecoder` decodes a channel's union and
drops (with a warning) a frame that is not exactly one of its messages. Nothing is ever pickled.
"""

from __future__ import annotations

import logging
from typing import Generic, TypeVar

import msgspec
from pagoda.server.outputs import EngineStats

logger = logging.getLogger(__name__)

InfoT = TypeVar("InfoT")
M = TypeVar("M")


class Ready(msgspec.Struct, Generic[InfoT], frozen=True, tag=True):
    """The child loaded its model and serves; `pid` is its process id on its node."""

    info: InfoT  # the child's description: an engine core's `EngineInfo`, a worker's rank
    pid: int
    token: str  # the launch's token from the child's spec (procs/security.py): a Ready without it is refused
    stats: EngineStats | None = None  # an engine core's stats before its first step; None from a worker


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    """Leave the loop and exit (an engine core aborts what it still runs)."""


class Failed(msgspec.Struct, frozen=True, tag=True):
    """The child could not start, or its loop failed; it exits after sending this."""

    message: str
    kind: str | None = None  # the class name of the exception it raised, when it raised one


class FrameDecoder(Generic[M]):
    """A typed msgpack decoder that drops (and logs) what does not decode instead of raising."""

    def __init__(self, message_type: type[M], what: str) -> None:
        self._decoder: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(message_type)
        self._what = what

    def decode_or_none(self, frame: bytes | memoryview) -> M | None:
        """The message of `frame`, or None (logged) when it is not a valid frame of this channel."""
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("dropped a malformed %s frame (%d bytes): %s", self._what, len(frame), exc)
            return None
