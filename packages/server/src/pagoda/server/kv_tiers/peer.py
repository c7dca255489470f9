"""KV blocks between engines that share no memory (prefill/decode disaggregation across hosts, `--kv-transfer tcp`).

Every engine core of such a server serves the blocks of its host tier over TCP (`KVBlockServer`: a ZeroMQ ROUTER
bound to a random port, one thread) and can pull blocks from another core's server into its own host tier
(`PeerFetcher`). Both sides use the server's per-launch CURVE keys (`LaunchKeys`, the same socket security as the
engine cores): the servers hold the server key pair, every core the client key pair, and each server's ZAP check
admits that client key only, so a process that did not get a core's spawn spec can neither connect nor read.

A decode core pulls at admission: a resumed request names the prefill core's server (`Resume.kv_source`), the
tier extension holds the request while `TieredOffload.prefetch` pulls the prompt blocks its own tier lacks, and
the request then loads them like any tier hit. A pulled block is written into a reserved host slot and committed
whole; a transfer that fails or times out reserves nothing (the blocks are recomputed), and the serving side
copies a block under its store's lock without pinning it, so neither side is left holding anything.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

import msgspec
import zmq
from pagoda.server.kv_tiers.host import SharedHostStore
from pagoda.server.procs.security import Authenticator, LaunchKeys, connect_securely, serve_securely

logger = logging.getLogger(__name__)

# How long a pull waits for its blocks before the request recomputes them instead.
FETCH_TIMEOUT_S = 10.0
_POLL_MS = 100


class KVTransferSpec(msgspec.Struct, frozen=True):
    """What an engine core needs to move blocks over TCP: the launch's keys and the address to serve on."""

    keys: LaunchKeys
    bind_host: str


class FetchBlocks(msgspec.Struct, frozen=True, tag=True):
    """Ask a core for the blocks of these keys."""

    keys: list[bytes]


class Blocks(msgspec.Struct, frozen=True, tag=True):
    """The answer: each key's block bytes, or None when the core's tier does not hold it."""

    payloads: list[bytes | None]


def local_address_towards(address: str) -> str:
    """The IP this host reaches `address`'s host from (its interface on that route); loopback for ipc:// or a
    local address. Connecting a UDP socket sends nothing: it only asks the kernel for the route."""
    parsed = urlparse(address)
    if parsed.scheme != "tcp" or parsed.hostname in (None, "127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((parsed.hostname, parsed.port or 9))
        address_ip: str = probe.getsockname()[0]
        return address_ip


class KVBlockServer:
    """Serves this core's host-tier blocks to the other cores of the launch, on a thread of its own."""

    def __init__(self, host: SharedHostStore, keys: LaunchKeys, bind_host: str = "127.0.0.1") -> None:
        self._host = host
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._authenticator = Authenticator(self._context)
        self._authenticator.allow(keys)
        self._socket = self._context.socket(zmq.ROUTER)
        serve_securely(self._socket, keys)
        port = self._socket.bind_to_random_port(f"tcp://{bind_host}")
        self.endpoint = f"tcp://{bind_host}:{port}"
        self.blocks_served = 0
        self.bytes_served = 0
        self._stop = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(FetchBlocks)
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._serve, name="kv-block-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Answer fetches until closed; a frame that is not a `FetchBlocks` is dropped."""
        while not self._stop.is_set():
            if not self._socket.poll(_POLL_MS):
                continue
            frames = self._socket.recv_multipart()
            if len(frames) != 2:
                continue
            try:
                request = self._decoder.decode(frames[1])
            except msgspec.DecodeError:
                logger.warning("KV block server: dropped a frame that is not a FetchBlocks")
                continue
            payloads = [self._host.read(key) for key in request.keys]
            found = [p for p in payloads if p is not None]
            self.blocks_served += len(found)
            self.bytes_served += sum(map(len, found))
            self._socket.send_multipart([frames[0], self._encoder.encode(Blocks(payloads))])

    def close(self) -> None:
        """Stop serving and release the socket."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._authenticator.stop()
        self._context.term()


class PeerFetcher:
    """Pulls blocks from other cores' `KVBlockServer`s (used by one thread: the tier's reader)."""

    def __init__(self, keys: LaunchKeys, timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self._keys = keys
        self._timeout_ms = int(timeout_s * 1000)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sockets: dict[str, zmq.Socket[bytes]] = {}
        self._decoder = msgspec.msgpack.Decoder(Blocks)

    def _socket(self, endpoint: str) -> zmq.Socket[bytes]:
        """The connection to `endpoint` (made once)."""
        found = self._sockets.get(endpoint)
        if found is None:
            found = self._context.socket(zmq.DEALER)
            connect_securely(found, self._keys.peer)
            found.connect(endpoint)
            self._sockets[endpoint] = found
        return found

    def fetch(self, endpoint: str, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's block from the core at `endpoint` (None: it does not hold it); TimeoutError when it does not
        answer in time (the connection is dropped, so a late answer never answers a later fetch)."""
        conn = self._socket(endpoint)
        conn.send(msgspec.msgpack.encode(FetchBlocks(list(keys))))
        if not conn.poll(self._timeout_ms):
            conn.close(linger=0)
            del self._sockets[endpoint]
            raise TimeoutError(f"the KV block server at {endpoint} did not answer")
        payloads = self._decoder.decode(conn.recv()).payloads
        if len(payloads) != len(keys):
            raise ValueError(f"{endpoint} answered {len(payloads)} blocks for {len(keys)} keys")
        return payloads

    def close(self) -> None:
        """Close every connection."""
        for conn in self._sockets.values():
            conn.close(linger=0)
        self._sockets.clear()
        self._context.term()


@dataclass(frozen=True, slots=True)
class PeerTransfer:
    """An engine's two sides of the TCP transfer: the server of its blocks and the fetcher of others'."""

    server: KVBlockServer
    fetcher: PeerFetcher

    @classmethod
    def start(cls, host: SharedHostStore, keys: LaunchKeys, bind_host: str) -> PeerTransfer:
        """Serve `host`'s blocks on `bind_host` and make a fetcher with the same keys."""
        return cls(KVBlockServer(host, keys, bind_host), PeerFetcher(keys))

    def close(self) -> None:
        """Stop both."""
        self.server.close()
        self.fetcher.close()
