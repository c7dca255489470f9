"""KV cache events: vLLM's wire format (decoded with vLLM's schema, written out here), ZeroMQ PUB and replay,
the config's keys, and a real engine whose events carry its prefix cache's hashes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from pagoda.blockalloc import BlockManager
from pagoda.server.kv_events import KVEventPublisher, KVEventsConfig, parse_kv_events_config
from pagoda.server.kv_events.config import DEFAULT_ENDPOINT
from pagoda.server.kv_events.keys import load_server_key, subscribe_securely
from pagoda.server.testing import make_tiny_model


# vLLM's schema (vllm/distributed/kv_events.py), written out: what a vLLM-compatible consumer decodes with.
class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VllmKVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(VllmKVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(VllmKVCacheEvent):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(VllmKVEventBatch)


def _subscriber(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, certificate: Path | None
) -> zmq.Socket[bytes]:
    """A consumer with its own key pair, keyed to the publisher's logged certificate."""
    assert certificate is not None
    sub = ctx.socket(zmq.SUB)
    subscribe_securely(sub, load_server_key(certificate))
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    time.sleep(0.3)  # PUB/SUB: a subscription reaches the publisher asynchronously
    return sub


def _receive(sub: zmq.Socket[bytes], pred: Any, timeout: float = 30.0) -> list[VllmKVEventBatch]:
    """Batches until one holds an event satisfying `pred`."""
    batches: list[VllmKVEventBatch] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sub.poll(100):
            _topic, seq, payload = sub.recv_multipart()
            assert len(seq) == 8
            batch = DECODER.decode(payload)
            batches.append(batch)
            if any(pred(e) for e in batch.events):
                return batches
    raise AssertionError(f"no matching event; got {batches}")


def test_stored_and_removed_events_carry_the_prefix_cache_hashes() -> None:
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"
    )
    kv = BlockManager(num_blocks=4, block_size=4)
    publisher = KVEventPublisher(config, medium="CPU", data_parallel_rank=3)
    kv.set_event_sink(publisher)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        assert publisher.endpoint is not None and publisher.endpoint.startswith("tcp://127.0.0.1:")
        sub = _subscriber(ctx, publisher.endpoint, publisher.certificate)
        prompt = list(range(1, 11))  # two full blocks
        assert kv.allocate_slots("a", prompt, len(prompt)) is not None
        batches = _receive(sub, lambda e: isinstance(e, BlockStored))
        stored = next(e for b in batches for e in b.events if isinstance(e, BlockStored))
        assert stored.block_hashes == list(kv.pool.cached_block_hash_to_block)
        assert stored.parent_block_hash is None and stored.token_ids == prompt[:8] and stored.block_size == 4
        assert stored.medium == "CPU" and batches[-1].data_parallel_rank == 3
        cached = set(kv.pool.cached_block_hash_to_block)
        kv.free("a")
        assert kv.allocate_slots("b", [99] * 16, 16) is not None  # needs every block: evicts both
        batches = _receive(sub, lambda e: isinstance(e, BlockRemoved))
        removed = {
            h for b in batches for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes
        }
        assert removed == cached

        # Replay: every buffered batch from sequence number 1, then the end marker.
        assert publisher.replay_endpoint is not None and publisher.certificate is not None
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        subscribe_securely(dealer, load_server_key(publisher.certificate))
        dealer.connect(publisher.replay_endpoint)
        dealer.send((1).to_bytes(8, "big"))
        replayed: list[VllmKVEventBatch] = []
        while True:
            assert dealer.poll(10_000)
            seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            replayed.append(DECODER.decode(payload))
        kinds = [type(e).__name__ for b in replayed for e in b.events]
        assert kinds[0] == "BlockStored" and "BlockRemoved" in kinds
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_config_keys_and_the_loopback_default() -> None:
    assert DEFAULT_ENDPOINT.startswith("tcp://127.0.0.1:")  # vLLM's default binds every interface
    assert parse_kv_events_config(None) == KVEventsConfig()
    text = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:6001",
            "topic": "kv",
            "replay_endpoint": "tcp://127.0.0.1:6002",
            "buffer_steps": 5,
        }
    )
    config = parse_kv_events_config(text)
    assert config.enable_kv_cache_events and config.topic == "kv" and config.buffer_steps == 5
    for bad, key in [
        ('{"enable_kv_cache_events": true, "colour": 1}', "colour"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"buffer_steps": "10"}', "buffer_steps"),
        ('{"endpoint": "http://x"}', "endpoint"),
        ("[1]", "kv_events_config"),
        ("{bad", "kv_events_config"),
    ]:
        with pytest.raises(ValueError, match=key):
            parse_kv_events_config(bad)


def test_a_real_engine_publishes_its_prefix_cache(tmp_path: Path) -> None:
    from pagoda.server.llm import LLM
    from pagoda.server.sampling_params import SamplingParams

    model = make_tiny_model("llama", tmp_path / "llama")
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*"})
    llm = LLM(
        str(model), num_kv_blocks=64, block_size=4, max_model_len=64, dtype="float32", kv_events_config=events
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        publisher = llm.engine.kv_events
        assert publisher is not None and publisher.endpoint is not None
        sub = _subscriber(ctx, publisher.endpoint, publisher.certificate)
        llm.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13]], SamplingParams(max_tokens=2, temperature=0.0))
        batches = _receive(sub, lambda e: isinstance(e, BlockStored))
        hashes = [h for b in batches for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes]
        kv = llm.engine.kv_manager
        assert isinstance(kv, BlockManager)
        assert hashes and set(hashes) <= set(kv.pool.cached_block_hash_to_block)
    finally:
        llm.engine.close()
        ctx.destroy(linger=0)


def test_each_replica_gets_its_own_endpoint() -> None:
    from pagoda.server.kv_events.config import for_replica

    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:6001", replay_endpoint="tcp://*:7001"
    )
    assert for_replica(config, 0) == config
    second = for_replica(config, 2)
    assert second is not None
    assert second.endpoint == "tcp://127.0.0.1:6003" and second.replay_endpoint == "tcp://*:7003"
    assert for_replica(None, 3) is None
    off = KVEventsConfig(enable_kv_cache_events=False)
    assert for_replica(off, 1) == off
