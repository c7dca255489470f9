"""KV cache events behind CURVE (#43, finding 1), through a live server: a subscriber without the server's key
receives nothing and gets no replay, one that read the logged certificate receives everything, a huge frame drops
its sender, and a process that binds a core's endpoint before the server cannot feed the router."""

from __future__ import annotations

import json
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from api_cases import MODEL
from pagoda.blockalloc.hashing import ROOT_BLOCK_HASH, hash_blocks, salt_bytes
from pagoda.server.kv_events.keys import load_server_key, subscribe_securely
from pagoda.server.kv_events.wire import BlockStored, KVEventBatch
from pagoda.server.testing import free_port, make_tiny_model
from test_api_live import LiveServer, serving, sync_client
from test_engine_core import CORE_FLAGS, READY_S, metric_value

DECODER = msgspec.msgpack.Decoder(KVEventBatch)
PREFIX = [10 + i for i in range(256)]  # 16 full blocks of 16 tokens
_CERTIFICATE = re.compile(r"public key is in (\S+)")


def certificate_of(live: LiveServer) -> Path:
    """The certificate file a server logged at INFO (the documented way in for a consumer)."""
    match = _CERTIFICATE.search(live.log_tail(100_000))
    assert match is not None, "the server logged no KV events certificate"
    return Path(match.group(1))


def subscriber(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, key: bytes | None) -> zmq.Socket[bytes]:
    """A SUB socket on `endpoint`: a CURVE client of `key`, or a plain one (None)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if key is not None:
        subscribe_securely(sub, key)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, key: bytes | None) -> zmq.Socket[bytes]:
    """A replay client on `endpoint`: a CURVE client of `key`, or a plain one (None)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if key is not None:
        subscribe_securely(sock, key)
    sock.connect(endpoint)
    return sock


def stored_batch(sub: zmq.Socket[bytes], timeout: float) -> KVEventBatch | None:
    """The first batch holding a BlockStored within `timeout` seconds (None: none came)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sub.poll(100):
            batch = DECODER.decode(sub.recv_multipart()[-1])
            if any(isinstance(e, BlockStored) for e in batch.events):
                return batch
    return None


def replayed(sock: zmq.Socket[bytes], timeout: float) -> int | None:
    """How many batches a replay from sequence number 1 answers (None: no answer within `timeout`)."""
    sock.send((1).to_bytes(8, "big"))
    count = 0
    while sock.poll(int(timeout * 1000)):
        seq, _payload = sock.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            return count
        count += 1
    return None


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("kvsec") / "llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def live(model: Path) -> Iterator[LiveServer]:
    """One in-process server publishing KV events (and replay) on loopback tcp."""
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }
    with serving(model, "--log-level", "info", "--kv-events-config", json.dumps(events)) as server:
        server.events = events  # type: ignore[attr-defined]
        yield server


def _endpoints(live: LiveServer) -> tuple[str, str]:
    events: dict[str, str] = live.events  # type: ignore[attr-defined]
    return events["endpoint"], events["replay_endpoint"]


def test_only_a_consumer_with_the_logged_key_receives_events(live: LiveServer) -> None:
    """The certificate is owner-only in a private folder; a plain subscriber gets nothing of what a keyed one
    gets (a prompt's token ids), and a plain replay request is never answered."""
    path = certificate_of(live)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    key = load_server_key(path)
    endpoint, replay_endpoint = _endpoints(live)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        plain, keyed = subscriber(ctx, endpoint, None), subscriber(ctx, endpoint, key)
        time.sleep(0.5)  # PUB/SUB: subscriptions reach the publisher asynchronously
        prompt = [*PREFIX[:32], 7, 8]
        sync_client(live).completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        batch = stored_batch(keyed, 30)
        assert batch is not None
        assert any(
            isinstance(e, BlockStored) and e.token_ids and e.token_ids == prompt[: len(e.token_ids)]
            for e in batch.events
        )
        assert plain.poll(1000) == 0  # the same batches never reached it
        assert replayed(dealer(ctx, replay_endpoint, None), 2.0) is None
        assert (replayed(dealer(ctx, replay_endpoint, key), 10.0) or 0) >= 1
    finally:
        ctx.destroy(linger=0)


def test_a_huge_frame_drops_its_sender_and_the_server_keeps_publishing(live: LiveServer) -> None:
    """A keyed client's 1 MiB frame to the replay socket closes its connection unanswered; others are served."""
    key = load_server_key(certificate_of(live))
    _, replay_endpoint = _endpoints(live)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sync_client(live).completions.create(model=MODEL, prompt=PREFIX[:40], max_tokens=2, temperature=0)
        huge = dealer(ctx, replay_endpoint, key)
        huge.send(b"\0" * (1 << 20))  # without a cap: read whole, taken as "replay from 0", answered
        assert huge.poll(2000) == 0
        assert (replayed(dealer(ctx, replay_endpoint, key), 10.0) or 0) >= 1
        reply = sync_client(live).completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
        assert reply.choices[0].finish_reason is not None
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    """A short directory for ipc:// endpoints (a socket path is limited to ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvsec", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(600)
def test_a_forged_publisher_cannot_feed_the_router(model: Path, ipc_dir: Path) -> None:
    """A process binds replica 0's ipc endpoint before the server starts (the router connects before its cores
    bind) and publishes that replica holds a prefix. Pinned to the cores' key, the router refuses the handshake
    and reconnects to the real core: the prefix's first request is a miss, not a forged hit."""
    endpoint = f"ipc://{ipc_dir}/kv"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    forger = ctx.socket(zmq.PUB)
    forger.setsockopt(zmq.LINGER, 0)
    forger.bind(endpoint)
    hashes = hash_blocks(PREFIX, 16, 0, 16, ROOT_BLOCK_HASH, salt_bytes(None))
    forged = msgspec.msgpack.encode(
        KVEventBatch(0.0, [BlockStored(list[bytes](hashes), None, PREFIX, 16, None, "CPU")], 0)
    )
    stop = threading.Event()

    def publish() -> None:
        while not stop.is_set():
            forger.send_multipart([b"", (1).to_bytes(8, "big"), forged])
            time.sleep(0.05)

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint})
    flags = (*CORE_FLAGS, "--data-parallel-size", "2", "--routing-kv-events", "--kv-events-config", events)
    try:
        with serving(model, *flags, ready_timeout=READY_S) as server:
            time.sleep(1.0)  # the forged batches have had every chance to arrive
            sync_client(server).completions.create(
                model=MODEL, prompt=[*PREFIX, 300, 301], max_tokens=2, temperature=0
            )
            text = httpx.get(f"{server.base_url}/metrics").text
            assert metric_value(text, 'pagoda:router_prefix_hits_total{model_name="' + MODEL + '"}') == 0.0
    finally:
        stop.set()
        thread.join(5)
        ctx.destroy(linger=0)
