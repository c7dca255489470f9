"""One engine core as the front end holds it: its sockets, its handle, its requests and its last stats."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from pagoda.server.core.deltas import DeltaDecoder
from pagoda.server.core.engine_core import CORE_PROGRAM, CoreSpec
from pagoda.server.core.messages import CoreInput, EngineInfo
from pagoda.server.kv_events.keys import KVEventsKeys
from pagoda.server.outputs import EngineStats
from pagoda.server.procs import Handle, Launcher, bind
from pagoda.server.procs.security import Authenticator, LaunchKeys, serve_securely

# Restart backoff: the first restart after this many seconds, doubling up to the cap while restarts keep failing.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
# A core answers each `AddRequest` (Accepted or Rejected) between two steps; one that has not after this long is
# wedged (or its frames are lost), and is failed and restarted rather than left holding requests forever.
ACCEPT_TIMEOUT_S = 60.0


@dataclass(slots=True)
class Replica:
    """Core `index` of the set. States: starting (no Ready yet), ready, dead (restart due at `restart_at`)."""

    index: int
    inputs: zmq.Socket[bytes] | None = None
    outputs: zmq.Socket[bytes] | None = None
    handle: Handle | None = None
    ready: bool = False
    ready_deadline: float = 0.0  # monotonic time by which a starting core must be Ready
    restart_at: float | None = None  # dead: when to start it again
    failures: int = 0  # consecutive failed starts (the backoff's exponent)
    restarts: int = 0
    generation: int = 0
    info: EngineInfo | None = None
    last_error: str | None = None  # what its last `Failed` frame said
    last_error_kind: str | None = None  # and the exception class it named
    stats: EngineStats | None = None
    decoder: DeltaDecoder = field(default_factory=DeltaDecoder)
    requests: dict[str, int] = field(default_factory=dict)  # request id -> tokens it may still take (routing)
    # Frames ZeroMQ would not take (the core's input is at its high-water mark), oldest first, and since when.
    backlog: deque[bytes] = field(default_factory=deque)
    full_since: float | None = None
    pending: dict[str, float] = field(default_factory=dict)  # request id -> when its Accepted is overdue
    keys: LaunchKeys | None = None  # this start's CURVE keys and token (procs/security.py)
    kv_events_keys: KVEventsKeys | None = None  # every start's KV events publisher keys (kv_events/keys.py)
    kv_transfer_keys: LaunchKeys | None = None  # every start's KV block transfer keys (`--kv-transfer tcp`)
    # The dashboard: the core's last `BlockMap` (a frame's replica object) and when the next one was asked for.
    block_map: dict[str, Any] | None = None
    map_asked_at: float | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus maximum output tokens of the requests routed here and not finished."""
        return sum(self.requests.values())

    def start(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        authenticator: Authenticator,
        launcher: Launcher,
        config_frame: bytes,
        timeout: float,
        send_hwm: int = 1000,
    ) -> None:
        """Bind fresh sockets (fresh keys) and launch the core; it is ready once its `Ready` frame arrives.

        At most `send_hwm` frames queue in ZeroMQ for the core; beyond that `send` keeps them in `backlog`."""
        self.generation += 1
        self.keys = LaunchKeys.new()
        authenticator.allow(self.keys)
        self.inputs = context.socket(zmq.PUSH)
        self.inputs.setsockopt(zmq.SNDHWM, send_hwm)
        self.outputs = context.socket(zmq.PULL)
        for socket in (self.inputs, self.outputs):
            serve_securely(socket, self.keys)
        name = f"core{self.index}-{self.generation}"
        input_address = bind(self.inputs, launcher.address(f"{name}-input"))
        output_address = bind(self.outputs, launcher.address(f"{name}-output"))
        spec = CoreSpec(
            config_frame,
            input_address,
            output_address,
            self.keys.peer,
            self.kv_events_keys,
            self.kv_transfer_keys,
        )
        self.handle = launcher.launch(CORE_PROGRAM, spec, index=self.index, name=f"engine core {self.index}")
        self.ready = False
        self.restart_at = None
        self.ready_deadline = time.monotonic() + timeout

    def send(self, encoder: msgspec.msgpack.Encoder, message: CoreInput) -> None:
        """Queue a frame for the core without ever blocking: into ZeroMQ, or the backlog while that is full.

        The front end has one sender thread for every core: a core that stops reading (a long step, a stopped
        process) must not hold up the frames of the others."""
        self.backlog.append(encoder.encode(message))
        self.flush(time.monotonic())

    def flush(self, now: float) -> None:
        """Hand backlogged frames to ZeroMQ, oldest first, until it is full again (`full_since` then says since
        when) or the backlog is empty."""
        if self.inputs is None:
            return
        while self.backlog:
            try:
                self.inputs.send(self.backlog[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if self.full_since is None:
                    self.full_since = now
                return
            self.backlog.popleft()
        self.full_since = None

    def stalled(self, now: float, timeout: float) -> bool:
        """Whether this ready core stayed full (not reading its frames) for more than `timeout` seconds."""
        return self.ready and self.full_since is not None and now - self.full_since > timeout

    def overdue(self, now: float) -> str | None:
        """A request whose `Accepted` (or `Rejected`) is overdue, or None."""
        return next((request_id for request_id, due in self.pending.items() if now > due), None)

    def mark_dead(self, now: float) -> list[str]:
        """Close the sockets, schedule the restart with backoff; returns the requests that were lost."""
        lost = list(self.requests)
        for request_id in lost:
            self.decoder.forget(request_id)
        self.requests.clear()
        self.backlog.clear()
        self.full_since = None
        self.pending.clear()
        for socket in (self.inputs, self.outputs):
            if socket is not None:
                socket.close(linger=0)
        self.inputs = self.outputs = None
        if self.handle is not None:
            self.handle.kill()
            self.handle.join(2.0)  # reap it: no zombie while the replacement starts
        self.ready = False
        self.stats = None
        self.block_map = self.map_asked_at = None
        delay = min(RESTART_BACKOFF_S * 2**self.failures, RESTART_BACKOFF_MAX_S)
        self.failures += 1
        self.restart_at = now + delay
        return lost
