"""`--routing-kv-events`: the server's cache-aware router follows its engine cores' KV cache events (each core
publishes on its own `--kv-events-config` endpoint, its batches carrying its data-parallel rank), and routes a
repeated prefix to the replica whose events reported it."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from api_cases import MODEL
from pagoda.server.cli import main
from pagoda.server.cli_args import build_parser, serve_config
from pagoda.server.kv_events.config import parse_kv_events_config
from pagoda.server.kv_events.keys import KVEventsKeys, load_server_key, publish_securely
from pagoda.server.kv_events.wire import BlockStored, KVEventBatch
from pagoda.server.testing import make_tiny_model
from test_api_live import LiveServer, serving, sync_client
from test_engine_core import CORE_FLAGS, READY_S, engine_metric, metric_value
from test_kv_events_security import certificate_of, subscriber

PREFIX = [10 + i for i in range(256)]  # 16 full blocks of 16 tokens


def _events_config(endpoint: str) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint})


@pytest.fixture(scope="module")
def ipc_dir() -> Iterator[Path]:
    """A short directory for ipc:// endpoints (a socket path is limited to ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvev", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--data-parallel-size", "2"],
            "--routing-kv-events needs --kv-events-config with enable_kv_cache_events",
        ),
        (
            ["--data-parallel-size", "2", "--routing-policy", "round_robin"],
            "--routing-kv-events needs --routing-policy cache_aware",
        ),
        ([], "--routing-kv-events needs engine-core replicas"),
    ],
)
def test_the_flag_needs_replicas_cache_aware_routing_and_zmq_events(flags: list[str], message: str) -> None:
    events = (
        [] if flags == ["--data-parallel-size", "2"] else ["--kv-events-config", _events_config("ipc:///x")]
    )
    args = build_parser().parse_args(["serve", "--routing-kv-events", *events, *flags])
    with pytest.raises(ValueError, match=message):
        serve_config(args)


def test_a_bad_combination_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--routing-kv-events", "--data-parallel-size", "2"]) == 2
    assert "--routing-kv-events" in capsys.readouterr().err


def _stored_on(subs: list[zmq.Socket[bytes]], timeout: float = 60.0) -> tuple[int, KVEventBatch]:
    """The first replica whose endpoint publishes a BlockStored, and that batch."""
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    poller = zmq.Poller()
    for sub in subs:
        poller.register(sub, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for sub, _ in poller.poll(500):
            batch = decoder.decode(sub.recv_multipart()[-1])
            if any(isinstance(e, BlockStored) for e in batch.events):
                return subs.index(sub), batch
    raise AssertionError("no BlockStored on either replica's endpoint")


@pytest.mark.timeout(900)
def test_the_router_follows_the_replicas_events(ipc_dir: Path, tmp_path: Path) -> None:
    """DP = 2: a prompt's BlockStored comes from one replica's endpoint with that replica's rank; the same prefix
    again is a router hit served from that replica's cache (the other computes nothing)."""
    model = make_tiny_model("llama", tmp_path / "llama", max_position_embeddings=4096)
    endpoint = f"ipc://{ipc_dir}/kv"
    flags = (*CORE_FLAGS, "--data-parallel-size", "2", "--routing-kv-events")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    subs: list[zmq.Socket[bytes]] = []
    try:
        with serving(
            Path(model), *flags, "--kv-events-config", _events_config(endpoint), ready_timeout=READY_S
        ) as live:
            # One key for every replica, read from the certificate the front end logged.
            key = load_server_key(certificate_of(live))
            # Replica 1's endpoint: the suffix -1 (as vLLM's offset).
            subs = [subscriber(context, e, key) for e in (endpoint, f"{endpoint}-1")]
            time.sleep(0.5)  # PUB/SUB: subscriptions reach the publishers asynchronously
            client = sync_client(live)
            first = client.completions.create(
                model=MODEL, prompt=[*PREFIX, 300, 301], max_tokens=2, temperature=0
            )
            replica, batch = _stored_on(subs)
            assert batch.data_parallel_rank == replica
            before = _prompt_tokens(live)
            second = client.completions.create(
                model=MODEL, prompt=[*PREFIX, 350, 351], max_tokens=2, temperature=0
            )
            after = _prompt_tokens(live)
            assert first.usage is not None and first.usage.prompt_tokens_details is not None
            assert second.usage is not None and second.usage.prompt_tokens_details is not None
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            assert second.usage.prompt_tokens_details.cached_tokens == 256
            computed = [a - b for a, b in zip(after, before, strict=True)]
            assert computed[replica] == 2 and computed[1 - replica] == 0  # only the tail, and only there
            text = httpx.get(f"{live.base_url}/metrics").text
            assert metric_value(text, 'pagoda:router_prefix_hits_total{model_name="' + MODEL + '"}') == 1.0
    finally:
        for sub in subs:
            sub.close(linger=0)
        context.term()


def _prompt_tokens(live: LiveServer) -> list[float]:
    text = httpx.get(f"{live.base_url}/metrics").text
    return [engine_metric(text, "pagoda:prompt_tokens_total", e) for e in ("0", "1")]


def test_subscriptions_apply_their_replicas_batches_and_refuse_others(ipc_dir: Path) -> None:
    """core/kv_subscriber.py on its own: a batch of the endpoint's rank (or none) is applied, in order; one
    naming another rank, or undecodable bytes, is refused; a wildcard host is connected on loopback."""
    from pagoda.server.core.kv_subscriber import KVEventSubscriptions, connect_address

    assert connect_address("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert connect_address("tcp://0.0.0.0:7") == "tcp://127.0.0.1:7"
    assert connect_address("tcp://10.0.0.2:7") == "tcp://10.0.0.2:7"
    assert connect_address("ipc:///run/kv-1") == "ipc:///run/kv-1"
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    applied: list[tuple[int, KVEventBatch]] = []
    endpoint = f"ipc://{ipc_dir}/unit"
    keys = KVEventsKeys.new()
    pubs = [context.socket(zmq.PUB) for _ in range(2)]
    for pub in pubs:
        publish_securely(pub, keys)
    pubs[0].bind(endpoint)
    pubs[1].bind(f"{endpoint}-1")
    events = parse_kv_events_config(_events_config(endpoint))
    subs = KVEventSubscriptions(context, events, 2, lambda i, b: applied.append((i, b)), keys.public)
    try:
        assert subs.endpoints == [endpoint, f"{endpoint}-1"]
        encode = msgspec.msgpack.encode
        stored = BlockStored([b"h" * 32], None, list(range(16)), 16, None, "CPU")
        # ZeroMQ's slow joiner: publish until the subscriptions are connected (the first batch arrives).
        deadline = time.monotonic() + 30
        while not applied and time.monotonic() < deadline:
            pubs[1].send_multipart([b"", (0).to_bytes(8, "big"), encode(KVEventBatch(0.0, [], 1))])
            time.sleep(0.05)
            subs.drain_all()
        assert applied and applied[-1][0] == 1
        applied.clear()
        pubs[1].send_multipart(
            [b"", (1).to_bytes(8, "big"), encode(KVEventBatch(1.0, [stored], 0))]
        )  # rank 0
        pubs[1].send_multipart([b"", (2).to_bytes(8, "big"), b"not msgpack"])
        pubs[1].send_multipart([b"", (3).to_bytes(8, "big"), encode(KVEventBatch(2.0, [stored], None))])
        pubs[1].send_multipart([b"", (4).to_bytes(8, "big"), encode(KVEventBatch(3.0, [stored], 1))])
        deadline = time.monotonic() + 30
        while len(applied) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            subs.drain(1)
        assert [(i, b.ts) for i, b in applied] == [(1, 2.0), (1, 3.0)]
        assert subs.num_refused == 2
    finally:
        subs.close()
        for pub in pubs:
            pub.close(linger=0)
        context.term()
