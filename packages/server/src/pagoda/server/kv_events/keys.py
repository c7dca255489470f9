"""CURVE on the KV events sockets: the publishers' key pair, its public certificate file, and the socket options.

A server makes one key pair per start for every publisher it runs (each engine core gets the secret half in its
spawn spec). The sockets are CURVE servers, so a peer that does not know the public key cannot complete the
handshake: it receives no batch, no replay, and (for the router, a CURVE client that pins that key) cannot pose
as a publisher. The public key is written, as a ZeroMQ certificate, to an owner-only file in a fresh private
folder whose path is logged at INFO: reading that file is what lets a consumer in (`load_server_key`); it then
connects with a key pair of its own (`subscribe_securely`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path

import msgspec
import zmq
import zmq.auth
from pagoda.server.kv_events.config import KVEventsConfig

logger = logging.getLogger(__name__)

# The largest frame a publisher reads: subscriptions (a topic) and replay requests (an 8-byte sequence number)
# are tiny; a peer that sends more is disconnected by ZeroMQ before it is buffered.
MAX_REQUEST_BYTES = 4096
# The largest batch a subscriber reads: a 10 ms batch of a 128k-token prefill is under a megabyte (token ids and
# 32-byte hashes); anything near this cap is not a batch.
MAX_BATCH_BYTES = 64 * 1024 * 1024
CERTIFICATE_NAME = "kv-events.key"


class KVEventsKeys(msgspec.Struct, frozen=True):
    """The publishers' CURVE key pair (z85 text); the secret half never leaves the spawn spec."""

    public: str
    secret: str

    @classmethod
    def new(cls) -> KVEventsKeys:
        """A fresh key pair."""
        public, secret = zmq.curve_keypair()
        return cls(public.decode(), secret.decode())


def publishing_keys(config: KVEventsConfig | None) -> KVEventsKeys | None:
    """Fresh keys when `config` publishes on ZeroMQ (None when events are off or go nowhere)."""
    if config is None or not config.enable_kv_cache_events or config.publisher != "zmq":
        return None
    return KVEventsKeys.new()


def write_certificate(keys: KVEventsKeys) -> Path:
    """Write the public key as a ZeroMQ certificate (0600, in a fresh 0700 folder) and log its path at INFO."""
    folder = Path(tempfile.mkdtemp(prefix="pagoda-kv-events-"))  # mkdtemp: 0700, a name no one can plant
    path = folder / CERTIFICATE_NAME
    text = (
        "#   ZeroMQ CURVE public certificate of a Pagoda server's KV cache events\n"
        "metadata\n"
        "curve\n"
        f'    public-key = "{keys.public}"\n'
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)
    logger.info("KV cache events: the publishers' CURVE public key is in %s", path)
    return path


def remove_certificate(path: Path) -> None:
    """Delete the certificate and its folder (the server stops: the key is void)."""
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        path.parent.rmdir()


def load_server_key(path: str | Path) -> bytes:
    """The publishers' public key (z85) from the certificate file the server logged."""
    public, _ = zmq.auth.load_certificate(path)
    return public


def publish_securely(socket: zmq.Socket[bytes], keys: KVEventsKeys) -> None:
    """Make a PUB or replay socket (before it binds) a CURVE server with tiny inbound frames."""
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.public.encode())
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode())
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)


def subscribe_securely(socket: zmq.Socket[bytes], server_public: bytes | str) -> None:
    """Make a consumer's socket (before it connects) a CURVE client of the publishers, with a key pair of its own."""
    public, secret = zmq.curve_keypair()
    key = server_public.encode() if isinstance(server_public, str) else server_public
    socket.setsockopt(zmq.CURVE_SERVERKEY, key)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, secret)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
