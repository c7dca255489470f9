"""KV blocks over TCP (issue 40, `--kv-transfer tcp`): a core's block server hands out the blocks of its host tier
to a fetcher holding the launch's keys, nobody else gets an answer, a bad frame is dropped, and a server that does
not answer is a TimeoutError that leaves nothing reserved. Two engines with tiers of their own: B pulls the prompt
blocks A computed and continues A's request with one engine's tokens."""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from pagoda.server.config import EngineConfig
from pagoda.server.engine import LLMEngine
from pagoda.server.handoff import Resume
from pagoda.server.kv_tiers.host import WAYS, SharedHostStore
from pagoda.server.kv_tiers.offload import TieredOffload
from pagoda.server.kv_tiers.peer import KVBlockServer, KVTransferSpec, PeerFetcher, local_address_towards
from pagoda.server.outputs import RequestOutput
from pagoda.server.procs.security import LaunchKeys
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from test_handoff_engine import prompts_of

SLOT = 64
IDENTITY = hashlib.sha256(b"model").digest()


def key(i: int) -> bytes:
    """A digest key."""
    return hashlib.sha256(str(i).encode()).digest()


@pytest.fixture
def host(tmp_path: Path) -> Iterator[SharedHostStore]:
    """A host tier of one set holding blocks 0..3 (block i is SLOT bytes of i)."""
    store = SharedHostStore.open(tmp_path / "tier", WAYS * SLOT, SLOT, IDENTITY, owner=True)
    for i in range(4):
        got = store.reserve(key(i))
        assert got is not None
        store.slot(got[0])[:] = bytes([i]) * SLOT
        store.commit(got[0])
    yield store
    store.close()


def test_a_fetch_gets_the_blocks_the_server_holds(host: SharedHostStore) -> None:
    """Held keys come back whole, in order; a key the tier lacks is None; the server counts what it served."""
    keys = LaunchKeys.new()
    server = KVBlockServer(host, keys)
    fetcher = PeerFetcher(keys, timeout_s=10)
    try:
        got = fetcher.fetch(server.endpoint, [key(2), key(9), key(0)])
        assert got == [bytes([2]) * SLOT, None, bytes([0]) * SLOT]
        assert (server.blocks_served, server.bytes_served) == (2, 2 * SLOT)
        assert fetcher.fetch(server.endpoint, [key(3)]) == [bytes([3]) * SLOT]  # the connection is kept
    finally:
        fetcher.close()
        server.close()


def test_a_fetcher_without_the_launchs_keys_gets_nothing(host: SharedHostStore) -> None:
    """Another launch's keys fail the handshake (ZAP refuses the client key): no answer, a TimeoutError."""
    server = KVBlockServer(host, LaunchKeys.new())
    stranger = PeerFetcher(LaunchKeys.new(), timeout_s=0.5)
    try:
        with pytest.raises(TimeoutError):
            stranger.fetch(server.endpoint, [key(0)])
        assert server.blocks_served == 0
    finally:
        stranger.close()
        server.close()


def test_a_bad_frame_is_dropped_and_the_server_serves_on(host: SharedHostStore) -> None:
    """A frame that is not a FetchBlocks gets no answer; the next good fetch on the same connection is answered."""
    keys = LaunchKeys.new()
    server = KVBlockServer(host, keys)
    fetcher = PeerFetcher(keys, timeout_s=10)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    raw = context.socket(zmq.DEALER)
    try:
        from pagoda.server.procs.security import connect_securely

        connect_securely(raw, keys.peer)
        raw.connect(server.endpoint)
        raw.send(b"\xc1 not msgpack")
        assert not raw.poll(300)
        assert fetcher.fetch(server.endpoint, [key(1)]) == [bytes([1]) * SLOT]
    finally:
        raw.close(linger=0)
        context.term()
        fetcher.close()
        server.close()


def test_a_server_that_does_not_answer_reserves_nothing(host: SharedHostStore, tmp_path: Path) -> None:
    """A pull from a closed server times out; the receiving tier stored nothing and holds no reservation."""
    keys = LaunchKeys.new()
    server = KVBlockServer(host, keys)
    endpoint = server.endpoint
    server.close()
    receiving = SharedHostStore.open(tmp_path / "other", WAYS * SLOT, SLOT, IDENTITY, owner=True)
    fetcher = PeerFetcher(keys, timeout_s=0.3)
    try:
        with pytest.raises(TimeoutError):
            fetcher.fetch(endpoint, [key(0)])
        assert receiving.scan_used() == 0 and receiving.reserve(key(0)) is not None
    finally:
        fetcher.close()
        receiving.close()


def test_the_bind_address_follows_the_route_to_the_front_end() -> None:
    """ipc:// and loopback bind on loopback; a tcp:// front end elsewhere binds on this host's route to it."""
    assert local_address_towards("ipc:///tmp/x") == "127.0.0.1"
    assert local_address_towards("tcp://127.0.0.1:5555") == "127.0.0.1"
    assert local_address_towards("tcp://10.1.2.3:5555").count(".") == 3


def run(
    engine: LLMEngine,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    resume: Resume | None = None,
) -> RequestOutput:
    """One request stepped to its end; its last output."""
    engine.add_request(request_id, prompt, params, resume=resume)
    last: RequestOutput | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out if out.request_id == request_id else last
    assert last is not None and last.finished
    return last


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_decode_engine_pulls_the_prompt_blocks_over_tcp(tmp_path: Path, arch: str) -> None:
    """Engines A and B, each with a host tier of its own: B resumes A's request naming A's block server, pulls
    its full prompt blocks (its cached tokens, its peer counters) and draws one engine's tokens."""
    model = make_tiny_model(arch, tmp_path / arch)
    flat = {
        "model": str(model),
        "block_size": 4,
        "num_kv_blocks": 64,
        "max_model_len": 64,
        "dtype": "float32",
    }
    keys = LaunchKeys.new()
    transfer = KVTransferSpec(keys, "127.0.0.1")
    one = LLMEngine.from_config(EngineConfig.from_flat(**flat))
    a = LLMEngine.from_config(
        EngineConfig.from_flat(**flat, kv_offloading_size=8 / 1024), kv_transfer=transfer
    )
    b = LLMEngine.from_config(
        EngineConfig.from_flat(**flat, kv_offloading_size=8 / 1024), kv_transfer=transfer
    )
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=7, ignore_eos=True)
    try:
        assert a.kv_endpoint is not None and a.kv_endpoint.startswith("tcp://127.0.0.1:")
        for i, prompt in enumerate(prompts_of((6, 13, 22), seed=5)):
            want = run(one, f"r{i}", prompt, params)
            first = run(a, f"r{i}", prompt, dataclasses.replace(params, max_tokens=1)).outputs[0]
            resume = Resume(list(first.token_ids), 4, kv_source=a.kv_endpoint)
            got = run(b, f"r{i}", prompt, params, resume)
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, (arch, len(prompt))
            assert got.num_cached_tokens == len(prompt) // 4 * 4
        assert b.kv_tiers is not None and isinstance(b.kv_tiers.connector, TieredOffload)
        (peer,) = [t for t in b.kv_tiers.connector.stats() if t.tier == "peer"]
        assert peer.hits > 0 and peer.bytes_in == peer.hits * b.kv_tiers.connector.host.slot_bytes
    finally:
        for engine in (one, a, b):
            engine.close()
