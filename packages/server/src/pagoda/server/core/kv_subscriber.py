"""The front end's subscription to its engine cores' KV cache events (`--routing-kv-events`): one ZeroMQ SUB
socket per replica, on that replica's `--kv-events-config` endpoint, feeding the cache-aware router's
`apply_events`, so that it routes by what each replica's prefix cache really holds."""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import zmq
from pagoda.server.kv_events.config import KVEventsConfig, for_replica
from pagoda.server.kv_events.keys import subscribe_securely
from pagoda.server.kv_events.wire import KVEventBatch

logger = logging.getLogger(__name__)

# Batches read per socket per call: a burst cannot hold the engine thread for long (the rest waits in ZeroMQ).
_MAX_BATCHES = 256


def connect_address(endpoint: str) -> str:
    """Where a subscriber connects to a publisher bound at `endpoint` (a wildcard host is this machine)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        if host in ("*", "0.0.0.0", ""):
            return f"tcp://127.0.0.1:{port}"
        if host in ("::", "[::]"):
            return f"tcp://[::1]:{port}"
    return endpoint


class KVEventSubscriptions:
    """SUB sockets on every replica's KV events endpoint; `drain` hands their batches to `apply(replica, batch)`."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        kv_events_config: KVEventsConfig | None,
        num_replicas: int,
        apply: Callable[[int, KVEventBatch], None],
        server_public: str | bytes,
    ) -> None:
        """Connect now, before the cores bind: ZeroMQ reconnects, and no early batch is missed for lack of it.

        Every socket is a CURVE client pinned to the cores' public key `server_public`: a process that binds an
        endpoint first (or in a core's place) cannot complete the handshake, so its batches never arrive."""
        self._apply = apply
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.sockets: list[zmq.Socket[bytes]] = []
        self.endpoints: list[str] = []
        self.num_batches = 0  # applied, for tests and logs
        self.num_refused = 0  # undecodable, or from another data-parallel rank than the endpoint's
        for index in range(num_replicas):
            config = for_replica(kv_events_config, index) or KVEventsConfig()
            socket = context.socket(zmq.SUB)
            socket.setsockopt(zmq.LINGER, 0)
            subscribe_securely(socket, server_public)
            socket.setsockopt(zmq.SUBSCRIBE, config.topic.encode())
            address = connect_address(config.endpoint)
            socket.connect(address)
            self.sockets.append(socket)
            self.endpoints.append(address)

    def drain(self, replica: int) -> None:
        """Apply the batches waiting on `replica`'s socket, in order."""
        socket = self.sockets[replica]
        for _ in range(_MAX_BATCHES):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                batch = self._decoder.decode(frames[-1])
            except msgspec.DecodeError:
                self.num_refused += 1
                continue
            # A batch naming another rank came from a misconfigured endpoint: it would corrupt this index.
            if batch.data_parallel_rank is not None and batch.data_parallel_rank != replica:
                self.num_refused += 1
                logger.warning(
                    "KV events of rank %s on replica %d's endpoint ignored", batch.data_parallel_rank, replica
                )
                continue
            self.num_batches += 1
            self._apply(replica, batch)

    def drain_all(self) -> None:
        """Apply every replica's waiting batches (before a routing decision)."""
        for replica in range(len(self.sockets)):
            self.drain(replica)

    def close(self) -> None:
        """Close the sockets."""
        for socket in self.sockets:
            socket.close(linger=0)
        self.sockets.clear()
