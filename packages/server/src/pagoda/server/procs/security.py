"""The sockets between processes: CURVE-encrypted and authenticated, bounded in frame size, a token in `Ready`.

The side that binds (the front end for its engine cores, the driver for its tensor-parallel workers) makes fresh
`LaunchKeys` per launch: a CURVE key pair of its own, one for its children, and a random token. The children's
half (`PeerKeys`) travels only inside the spawn spec (stdin, or the Ray actor's argument), so a process that did
not get the spec can neither complete the CURVE handshake (it does not know the server's key) nor pass the ZAP
check (its key is not the children's): it receives nothing and its frames never arrive. Every socket also drops
a peer that sends a frame over `MAX_FRAME_BYTES` (ZeroMQ closes that connection), and a child's `Ready` must carry
the launch's token, so that a forged one is refused.
"""

from __future__ import annotations

import hmac
import logging
import secrets

import msgspec
import zmq
import zmq.auth.thread

logger = logging.getLogger(__name__)

# The largest frame any Pagoda socket accepts (ZMQ_MAXMSGSIZE): 256 MiB. The largest legitimate frames are an
# `AddRequest` of a long prompt (8 bytes a token id, plus its text: a few MB at 128k tokens), an `Outputs` of a
# step with prompt logprobs (20 alternatives a position: tens of MB at 128k positions) and a tensor-parallel
# `Execute` (a step's scheduler output: block tables, a few MB). A peer that sends more is disconnected.
MAX_FRAME_BYTES = 256 * 1024 * 1024
# The ZAP domain of Pagoda's sockets (ZeroMQ asks the authenticator about every handshake in it).
ZAP_DOMAIN = "pagoda"


class PeerKeys(msgspec.Struct, frozen=True):
    """The children's half of a launch's keys (z85 text), sent in their spec: never logged, never on a socket."""

    server_public: str
    public: str
    secret: str
    token: str  # every `Ready` of this launch carries it


class LaunchKeys(msgspec.Struct, frozen=True):
    """The binding side's keys of one launch and the children's half (`peer`)."""

    server_public: str
    server_secret: str
    peer: PeerKeys

    @classmethod
    def new(cls) -> LaunchKeys:
        """Fresh key pairs and a fresh 128-bit token."""
        server_public, server_secret = zmq.curve_keypair()
        public, secret = zmq.curve_keypair()
        peer = PeerKeys(server_public.decode(), public.decode(), secret.decode(), secrets.token_hex(16))
        return cls(server_public.decode(), server_secret.decode(), peer)


def limit_frames(socket: zmq.Socket[bytes], max_bytes: int = MAX_FRAME_BYTES) -> None:
    """Disconnect a peer that sends a frame over `max_bytes` instead of buffering it."""
    socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)


def serve_securely(socket: zmq.Socket[bytes], keys: LaunchKeys, max_bytes: int = MAX_FRAME_BYTES) -> None:
    """Make `socket` (before it binds) a CURVE server whose ZAP check admits only the launch's children."""
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public.encode())
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret.encode())
    socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    limit_frames(socket, max_bytes)


def connect_securely(socket: zmq.Socket[bytes], peer: PeerKeys, max_bytes: int = MAX_FRAME_BYTES) -> None:
    """Make `socket` (before it connects) a CURVE client of the launch's server with the children's key."""
    socket.setsockopt(zmq.CURVE_SERVERKEY, peer.server_public.encode())
    socket.setsockopt(zmq.CURVE_PUBLICKEY, peer.public.encode())
    socket.setsockopt(zmq.CURVE_SECRETKEY, peer.secret.encode())
    limit_frames(socket, max_bytes)


class _AllowedKeys:
    """The ZAP credentials provider: the client keys (z85) of the launches this context serves."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        """True for a key of one of the launches; the rest are refused (and logged)."""
        allowed = any(hmac.compare_digest(key, known) for known in self.keys)
        if not allowed:
            logger.warning("refused a connection with an unknown CURVE key (domain %r)", domain)
        return allowed


class Authenticator:
    """ZeroMQ's ZAP handler for one context, in a thread: admits the client keys of `allow`ed launches only."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._allowed = _AllowedKeys()
        self._thread = zmq.auth.thread.ThreadAuthenticator(context, log=logger)
        self._thread.start()
        self._thread.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self._allowed)

    def allow(self, keys: LaunchKeys) -> None:
        """Admit the children of this launch (their public key, as z85 text)."""
        self._allowed.keys.add(keys.peer.public.encode())

    def stop(self) -> None:
        """Stop the thread (before the context terminates)."""
        self._thread.stop()


def token_matches(given: str, keys: PeerKeys) -> bool:
    """Whether a `Ready`'s token is the launch's (compare_digest: the time taken tells nothing)."""
    return hmac.compare_digest(given.encode(), keys.token.encode())
