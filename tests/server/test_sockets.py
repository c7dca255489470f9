"""The sockets between Pagoda's processes: CURVE keys from the spawn spec, bounded frames, a token in `Ready`, an
`Accepted` deadline, and nothing listening beyond loopback (front end, engine cores, tensor-parallel workers)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import openai
import psutil
import pytest
import zmq
from api_cases import MODEL
from pagoda.server.async_llm import AsyncLLM
from pagoda.server.client_stream import ReplicaDeadError, RequestFailed
from pagoda.server.config import EngineConfig, ServingConfig
from pagoda.server.core import CoreClient
from pagoda.server.core import client as core_client
from pagoda.server.core.messages import AddRequest, Outputs
from pagoda.server.core.replica import Replica
from pagoda.server.engine.executor.distributed import _wait_ready
from pagoda.server.engine.executor.messages import WorkerReady
from pagoda.server.outputs import EngineStats
from pagoda.server.procs import Failed, ProcessLauncher
from pagoda.server.procs.security import (
    MAX_FRAME_BYTES,
    Authenticator,
    LaunchKeys,
    connect_securely,
    serve_securely,
)
from pagoda.server.routing import build_router
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model
from test_api_live import serving

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (4 heads: tensor parallel 2 splits it)."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


def _endpoint(socket: zmq.Socket[bytes] | None) -> str:
    assert socket is not None
    endpoint = socket.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()


def _stats() -> EngineStats:
    return EngineStats(0, 0, 0, 0.0, 16, 16, 0, 0, 0, 0, 0, 0, True)


def _generate(client: CoreClient, count: int) -> list[int]:
    """Greedy token counts of `count` requests through an AsyncLLM over `client`."""

    async def run() -> list[int]:
        llm = AsyncLLM(client, ServingConfig(served_model_name=MODEL))
        llm.start()
        try:

            async def one(i: int) -> int:
                last = None
                async for output in llm.generate(f"r{i}", [5 + i, 6, 7], GREEDY):
                    last = output
                assert last is not None
                return len(last.outputs[0].token_ids)

            return list(await asyncio.gather(*(one(i) for i in range(count))))
        finally:
            await asyncio.to_thread(llm.shutdown)

    return asyncio.run(run())


@pytest.mark.timeout(600)
def test_intruders_get_nothing_and_inject_nothing(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peers without the launch's keys (none, a wrong server key, the right server key with a key of their own)
    connect to a core's sockets: they receive no `AddRequest`, their forged `Outputs` and `Failed` never arrive,
    and the core serves every request. Then a lost `AddRequest` fails its replica once `Accepted` is overdue."""
    config = EngineConfig.from_flat(
        model=str(model_dir), num_kv_blocks=64, dtype="float32", max_model_len=256
    )
    client = CoreClient(config, ProcessLauncher(1, logging.INFO), build_router("round_robin", 1, 16), 1)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    thieves: list[zmq.Socket[bytes]] = []
    forgers: list[zmq.Socket[bytes]] = []
    try:
        replica = client.replicas[0]
        assert replica.inputs is not None and replica.outputs is not None and replica.keys is not None
        for socket in (replica.inputs, replica.outputs):
            assert socket.getsockopt(zmq.MAXMSGSIZE) == MAX_FRAME_BYTES
            assert socket.getsockopt(zmq.CURVE_SERVER) == 1
        stranger = LaunchKeys.new()
        spoofed = msgspec.structs.replace(stranger.peer, server_public=replica.keys.server_public)
        for peer in (None, stranger.peer, spoofed):
            thief, forger = context.socket(zmq.PULL), context.socket(zmq.PUSH)
            for socket in (thief, forger):
                socket.setsockopt(zmq.LINGER, 0)
                if peer is not None:
                    connect_securely(socket, peer)
            thief.connect(_endpoint(replica.inputs))
            forger.connect(_endpoint(replica.outputs))
            thieves.append(thief)
            forgers.append(forger)
        time.sleep(
            0.5
        )  # let the handshakes fail (a plain PUSH would have round-robined frames to the thieves)
        forged = [
            Failed("forged"),
            Outputs(outputs=[], stats=_stats()),
            AddRequest("x", [1], SamplingParams()),
        ]
        for forger in forgers:
            for message in forged:
                with contextlib.suppress(zmq.Again):  # never connected: nothing to send to
                    forger.send(msgspec.msgpack.encode(message), zmq.NOBLOCK)
        assert _generate(client, 6) == [6] * 6
        assert all(thief.poll(200) == 0 for thief in thieves)
        handle = replica.handle
        assert handle is not None and handle.is_alive() and replica.restarts == 0 and replica.ready

        # A core that never answers an AddRequest (here: the frame is lost) is failed, its requests with it.
        monkeypatch.setattr(core_client, "ACCEPT_TIMEOUT_S", 0.2)
        monkeypatch.setattr(Replica, "send", lambda self, encoder, message: None)
        client.add_request("lost", [5, 6, 7], GREEDY)
        deadline = time.monotonic() + 30
        failed: list[RequestFailed] = []
        while not failed and time.monotonic() < deadline:
            failed = [e for e in client.step() if isinstance(e, RequestFailed) and e.request_id == "lost"]
        assert failed and isinstance(failed[0].error, ReplicaDeadError)
        assert "not accepted" in str(failed[0].error)
    finally:
        for socket in (*thieves, *forgers):
            socket.close(linger=0)
        context.term()
        client.close()


def test_oversized_frames_are_dropped() -> None:
    """A frame over the socket's bound never arrives (ZeroMQ drops its sender); frames within it do."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    authenticator = Authenticator(context)
    keys = LaunchKeys.new()
    authenticator.allow(keys)
    server = context.socket(zmq.PULL)
    serve_securely(server, keys, max_bytes=4096)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    senders = [context.socket(zmq.PUSH) for _ in range(2)]
    try:
        for sender in senders:
            sender.setsockopt(zmq.LINGER, 0)
            connect_securely(sender, keys.peer)
            sender.connect(f"tcp://127.0.0.1:{port}")
        senders[0].send(b"x" * 8192)
        senders[1].send(b"small")
        assert server.poll(10_000)
        assert server.recv() == b"small"
        assert server.poll(300) == 0  # the oversized frame never comes
    finally:
        for socket in (server, *senders):
            socket.close(linger=0)
        authenticator.stop()
        context.term()


class _Running:
    """A worker handle that stays alive."""

    def describe(self) -> str:
        return "worker"

    def is_alive(self) -> bool:
        return True

    def describe_exit(self) -> str:
        return "still running"

    def kill(self) -> None:
        pass

    def join(self, timeout: float) -> bool:
        return True


def test_forged_or_malformed_worker_ready_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """`_wait_ready` drops frames of the wrong shape or type, refuses a Ready without the launch's token or of a
    rank that does not exist, and routes to the identity of the real worker's Ready."""
    keys = LaunchKeys.new()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    peers = {name: context.socket(zmq.DEALER) for name in (b"evil", b"rank1")}
    try:
        for name, socket in peers.items():
            socket.setsockopt(zmq.IDENTITY, name)
            socket.connect(f"tcp://127.0.0.1:{port}")
        token = keys.peer.token
        evil = peers[b"evil"]
        evil.send_multipart([b"a", b"b"])  # three parts at the router
        evil.send(b"\xc1garbage")
        evil.send(msgspec.msgpack.encode({"type": "Ready", "info": 1, "pid": 1}))  # no token
        evil.send(msgspec.msgpack.encode(WorkerReady(info=1, pid=1, token="0" * 32)))
        evil.send(msgspec.msgpack.encode(WorkerReady(info=7, pid=1, token=token)))  # no such rank
        with caplog.at_level(logging.WARNING), ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(_wait_ready, router, [_Running()], keys.peer)
            expected = (
                "dropped a worker control frame of 3 parts",
                "dropped a malformed worker control frame",
                "refused a worker Ready without this launch's token",
                "refused a worker Ready of rank 7",
            )
            deadline = time.monotonic() + 60
            try:
                while not all(text in caplog.text for text in expected):  # the forgeries are refused first
                    assert time.monotonic() < deadline and not waiting.done()
                    time.sleep(0.05)
            finally:  # the real worker's Ready ends the wait whatever happened
                peers[b"rank1"].send(msgspec.msgpack.encode(WorkerReady(info=1, pid=2, token=token)))
            assert waiting.result(timeout=60) == [b"rank1"]
    finally:
        for socket in (router, *peers.values()):
            socket.close(linger=0)
        context.term()


def _beyond_loopback(pid: int) -> list[str]:
    """The inet sockets of `pid` bound (listening, or UDP) to an address other than loopback."""
    found = []
    for conn in psutil.Process(pid).net_connections(kind="inet"):
        bound = conn.status == psutil.CONN_LISTEN or conn.type == 2  # SOCK_DGRAM: no listen state
        if bound and conn.laddr and not ipaddress.ip_address(conn.laddr.ip).is_loopback:
            found.append(f"pid {pid}: {conn.laddr.ip}:{conn.laddr.port} ({conn.status})")
    return found


@pytest.mark.timeout(600)
def test_no_process_listens_beyond_loopback(model_dir: Path) -> None:
    """A server with an engine-core process whose engine runs tensor parallel 2 (mp): the front end, the core and
    the worker listen on loopback only (the store is a file, gloo binds 127.0.0.1, the sockets are ipc://)."""
    flags = ("--engine-core", "process", "--tensor-parallel-size", "2", "--max-model-len", "256")
    with serving(model_dir, *flags, ready_timeout=300) as live:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0, timeout=120)
        result = client.completions.create(
            model=MODEL, prompt="hi", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert result.choices[0].finish_reason == "length"
        server = psutil.Process(live.process.pid)
        processes = [server, *server.children(recursive=True)]
        assert len(processes) >= 3  # front end, engine core, its tensor-parallel worker
        listening = [
            c for p in processes for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
        ]
        assert listening  # the HTTP port and gloo's, at least
        assert [entry for p in processes for entry in _beyond_loopback(p.pid)] == []
