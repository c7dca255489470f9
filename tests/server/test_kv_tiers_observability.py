"""What the KV tiers report (issue 39): the host tier's stored-block count kept in its header (never a scan), the
tiers' stats through EngineStats (across the engine-core wire, summed over replicas with a shared tier's occupancy
counted once), /metrics per tier, the dashboard's tier series and frame, and the host tier's KV events (medium
CPU_TIER): exactly the group-0 blocks it stores and evicts, in the engine publisher's batches."""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from pagoda.server.core.client import sum_stats
from pagoda.server.core.messages import Outputs, output_decoder
from pagoda.server.dashboard.series import SeriesRecorder
from pagoda.server.dashboard.snapshot import EngineSnapshot
from pagoda.server.kv_events import BlockRemoved, BlockStored, KVEventBatch
from pagoda.server.kv_events.wire import HOST_TIER_MEDIUM
from pagoda.server.kv_tiers.connector import KVTierStats
from pagoda.server.kv_tiers.extension import KVTierExtension
from pagoda.server.kv_tiers.host import VALID, WAYS, SharedHostStore
from pagoda.server.kv_tiers.offload import TieredOffload
from pagoda.server.llm import LLM
from pagoda.server.metrics import ServerMetrics
from pagoda.server.outputs import EngineStats
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model
from test_engine_core import metric_value

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def engine_stats(*tiers: KVTierStats) -> EngineStats:
    """An idle engine's stats with `tiers`."""
    return EngineStats(0, 0, 0, 0.0, 100, BS, 0, 0, 0, 0, 0, kv_tiers=tiers)


def test_the_stored_count_follows_every_mutation_and_is_shared(tmp_path: Path) -> None:
    """Random reserve / commit / abandon on a tier of two sets, evictions included: the header's count always equals
    a scan of the slots, and a second process's view (another mapping of the file) reads the same count."""
    path = tmp_path / "tier"
    store = SharedHostStore.open(path, 2 * WAYS * 64, 64, b"i" * 32, owner=True)
    other = SharedHostStore.open(path, 2 * WAYS * 64, 64, b"i" * 32, owner=False)
    rng = random.Random(0)
    try:
        assert store.num_slots == 2 * WAYS and store.stats().num_used == 0
        evictions = 0
        for i in range(12 * WAYS):
            key = hashlib.sha256(str(rng.randrange(4 * WAYS)).encode()).digest()
            got = (store if i % 2 else other).reserve(key)
            if got is None:
                continue
            slot, evicted = got
            evictions += evicted is not None
            if rng.random() < 0.2:
                store.abandon(slot)
            else:
                other.commit(slot)
            assert store.stats().num_used == other.stats().num_used == store.scan_used()
        used = store.scan_used()
        assert evictions > 0 and used > WAYS
        # A fresh attach recounts (it repairs a count a killed process left half-updated).
        store.data[264:272] = (5).to_bytes(8, "little")  # host._USED_AT
        third = SharedHostStore.open(path, 2 * WAYS * 64, 64, b"i" * 32, owner=False)
        assert third.stats().num_used == store.stats().num_used == used
        third.close()
    finally:
        other.close()
        store.close()


def test_tier_stats_cross_the_wire_and_sum_over_replicas() -> None:
    """EngineStats.kv_tiers survive msgspec (an Outputs frame), and summing two replicas adds their hits and
    bytes but counts the shared tiers' occupancy once (the larger report)."""
    host = KVTierStats("host", 3, 4096, 1024, 2048, 8192)
    disk = KVTierStats("disk", 1, 100, 50, 500, 10_000)
    frame = msgspec.msgpack.encode(Outputs(outputs=[], stats=engine_stats(host, disk)))
    decoded = output_decoder().decode_or_none(frame)
    assert isinstance(decoded, Outputs) and decoded.stats.kv_tiers == (host, disk)
    other = KVTierStats("host", 2, 1000, 10, 3072, 8192)
    total = sum_stats([engine_stats(host, disk), engine_stats(other), engine_stats()])
    assert total.kv_tiers == (
        KVTierStats("host", 5, 5096, 1034, 3072, 8192),
        disk,
    )
    assert sum_stats([engine_stats()]).kv_tiers == ()


def test_metrics_have_per_tier_hits_bytes_and_occupancy() -> None:
    """vLLM-style names, one series per tier; none without tiers."""
    stats = engine_stats(
        KVTierStats("host", 3, 4096, 1024, 2048, 8192), KVTierStats("disk", 1, 100, 50, 500, 9)
    )
    text = ServerMetrics("m", lambda: stats).render().decode()
    for name, host, disk in (
        ("pagoda:kv_tier_hits_total", 3, 1),
        ("pagoda:kv_tier_bytes_in_total", 4096, 100),
        ("pagoda:kv_tier_bytes_out_total", 1024, 50),
        ("pagoda:kv_tier_used_bytes", 2048, 500),
        ("pagoda:kv_tier_capacity_bytes", 8192, 9),
    ):
        assert metric_value(text, name + '{model_name="m",tier="host"}') == host
        assert metric_value(text, name + '{model_name="m",tier="disk"}') == disk
    assert 'tier="' not in ServerMetrics("m", lambda: engine_stats()).render().decode()


def test_the_dashboard_series_has_tier_usage_and_hit_rates() -> None:
    """A point per second: the host tier's fraction in use and blocks served per second; None without a tier."""
    recorder = SeriesRecorder()

    def snap(t: float, stats: EngineStats) -> EngineSnapshot:
        return EngineSnapshot(time=t, replicas=(), stats=stats, ttft=(), itl=())

    assert recorder.observe(snap(0.0, engine_stats(KVTierStats("host", 10, 0, 0, 0, 1000))), 0.0) is None
    point = recorder.observe(snap(2.0, engine_stats(KVTierStats("host", 30, 0, 0, 250, 1000))), 2.0)
    assert point is not None
    assert (point.host_tier_usage, point.host_tier_hits) == (0.25, 10.0)
    assert (point.disk_tier_usage, point.disk_tier_hits) == (None, None)
    plain = SeriesRecorder()
    plain.observe(snap(0.0, engine_stats()), 0.0)
    bare = plain.observe(snap(1.0, engine_stats()), 1.0)
    assert bare is not None and bare.host_tier_usage is None and bare.to_json()["host_tier_hits"] is None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama (one KV cache group: every key is group 0's)."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tier-obs") / "llama")


def _batches(llm: LLM) -> list[KVEventBatch]:
    """Every batch the engine's ("null") publisher made, after it closed (the last ones flushed)."""
    publisher = llm.engine.kv_events
    assert publisher is not None
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    return [decoder.decode(payload) for _, payload in publisher._buffer]


def test_the_host_tier_publishes_what_it_stores_and_evicts(model_dir: Path) -> None:
    """A host tier of one set (WAYS slots) and prompts worth more blocks: the tier's BlockStored events are exactly the
    device's (write-through), its BlockRemoved events the evicted ones, and what they leave is what the shared
    file holds; EngineStats reports the tier (occupancy from the file's count, this engine's hits and bytes)."""
    args: dict[str, Any] = {
        "block_size": BS,
        "num_kv_blocks": 128,  # the device keeps every block: what the tier holds is a subset of it
        "max_model_len": 64,
        "dtype": "float32",
        "kv_offloading_size": 1e-9,  # one set
        "kv_events_config": {"enable_kv_cache_events": True, "publisher": "null"},
    }
    llm = LLM(str(model_dir), **args)
    tiers = llm.engine.kv_tiers
    assert isinstance(tiers, KVTierExtension) and isinstance(tiers.connector, TieredOffload)
    offload = tiers.connector
    rng = random.Random(1)
    try:
        assert offload.host.num_slots == WAYS
        for _ in range(8):
            prompt = [rng.randrange(3, 300) for _ in range(41)]
            llm.generate([prompt], GREEDY, use_tqdm=False)
        stats = llm.engine.get_stats().kv_tiers
        used = offload.host.stats().num_used
        assert used == WAYS == offload.host.scan_used()
        slot = offload.host.slot_bytes
        assert stats == (
            KVTierStats(
                "host", offload.host_hits, offload.host_in, offload.host_out, WAYS * slot, WAYS * slot
            ),
        )
        assert offload.host_in > WAYS * slot  # more stored than fits: evictions happened
        # What the shared file holds, read from its slots (the publisher's last batch may not be out yet).
        held = set()
        for slot in range(offload.host.num_slots):
            key, n, state, _, _, _ = offload.host._meta(slot)
            if state == VALID:
                held.add(key[:n])
    finally:
        llm.engine.close()
    tier_stored: list[bytes] = []
    tier_removed: list[bytes] = []
    device_stored: set[bytes] = set()
    for batch in _batches(llm):
        for event in batch.events:
            if isinstance(event, BlockStored) and event.medium == HOST_TIER_MEDIUM:
                assert event.block_size == BS and event.parent_block_hash is None
                tier_stored += event.block_hashes
            elif isinstance(event, BlockStored):
                device_stored.update(event.block_hashes)
            elif isinstance(event, BlockRemoved) and event.medium == HOST_TIER_MEDIUM:
                tier_removed += event.block_hashes
    assert len(tier_stored) == len(set(tier_stored)) and set(tier_stored) == device_stored
    assert len(tier_removed) == len(tier_stored) - WAYS > 0
    assert set(tier_stored) - set(tier_removed) == held and len(held) == WAYS


def test_stats_of_an_engine_without_tiers_are_empty(model_dir: Path) -> None:
    """No tier, no tier stats (and no tier events)."""
    llm = LLM(str(model_dir), block_size=BS, num_kv_blocks=32, max_model_len=64, dtype="float32")
    try:
        assert llm.engine.kv_tiers is None and llm.engine.get_stats().kv_tiers == ()
        assert replace(llm.engine.get_stats(), kv_tiers=()) == llm.engine.get_stats()
    finally:
        llm.engine.close()
