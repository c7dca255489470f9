"""The cache-aware router fed by its replicas' KV cache events against its approximate index: two replicas
modelled by real BlockManagers whose events (vLLM's wire structs) feed the router."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from pagoda.blockalloc import BlockHash, BlockManager
from pagoda.server.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagoda.server.routing import CacheAwareRouter, ReplicaLoad

BLOCK = 4
IDLE = ReplicaLoad(alive=True, num_running=0, num_waiting=0, num_tokens=0, kv_cache_usage=0.0)


class Feed:
    """One replica's event sink: each event goes to the router at once as a one-event batch."""

    def __init__(self, router: CacheAwareRouter, replica: int) -> None:
        self.router, self.replica = router, replica

    def blocks_stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        event = BlockStored(list(block_hashes), parent_hash, list(token_ids), block_size, None, "CPU")
        self.router.apply_events(self.replica, KVEventBatch(0.0, [event]))

    def blocks_removed(self, block_hashes: Sequence[BlockHash]) -> None:
        self.router.apply_events(self.replica, KVEventBatch(0.0, [BlockRemoved(list(block_hashes), "CPU")]))

    def all_cleared(self) -> None:
        self.router.apply_events(self.replica, KVEventBatch(0.0, [AllBlocksCleared()]))


def _replicas(router: CacheAwareRouter, num_blocks: int, events: bool) -> list[BlockManager]:
    kvs = [BlockManager(num_blocks, BLOCK) for _ in range(2)]
    if events:
        for i, kv in enumerate(kvs):
            kv.set_event_sink(Feed(router, i))
    return kvs


def _serve(kv: BlockManager, seq_id: str, prompt: list[int]) -> int:
    """Run one request's prefill on `kv` and finish it; the cached tokens it found."""
    cached = kv.get_num_cached_tokens(prompt, max_tokens=len(prompt) - 1)
    out = kv.allocate_slots(seq_id, prompt, len(prompt) - cached, num_computed_tokens=cached)
    assert out is not None
    kv.free(seq_id)
    return cached


def _shared_prefix_hit_rate(events: bool, num_blocks: int, seed: int = 0) -> float:
    """The shared-prefix workload: 8 system prompts of 8 blocks, a 1-block question, shuffled rounds of 8."""
    router = CacheAwareRouter(2, BLOCK, max_blocks_per_replica=num_blocks, use_kv_events=events)
    kvs = _replicas(router, num_blocks, events)
    rng = random.Random(seed)
    systems = [[1000 * (k + 1) + j for j in range(8 * BLOCK)] for k in range(8)]
    n = 0
    for _ in range(16):
        order = list(range(8))
        rng.shuffle(order)
        for k in order:
            n += 1
            prompt = systems[k] + [7, n % 97, n, 5, 1]
            _serve(kvs[router.route(prompt, [IDLE, IDLE])], f"r{n}", prompt)
    hits = sum(kv.stats().prefix_cache_hits for kv in kvs)
    queries = sum(kv.stats().prefix_cache_queries for kv in kvs)
    return hits / queries


@pytest.mark.parametrize("num_blocks", [200, 48])  # roomy, and a pool that holds ~2.5 system prompts
def test_events_reach_at_least_the_approximate_hit_rate(num_blocks: int) -> None:
    approximate = _shared_prefix_hit_rate(events=False, num_blocks=num_blocks)
    from_events = _shared_prefix_hit_rate(events=True, num_blocks=num_blocks)
    print(f"{num_blocks} blocks per replica: approximate {approximate:.1%}, events {from_events:.1%}")
    assert from_events >= approximate


def test_after_an_eviction_events_are_right_where_the_index_is_wrong() -> None:
    """A prefix routed to replica 0 is evicted there by later prompts: the approximate index still routes it to
    replica 0 as a hit (it finds nothing cached), the events router knows no replica holds it."""
    results = {}
    for events in (False, True):
        router = CacheAwareRouter(2, BLOCK, use_kv_events=events)
        kvs = _replicas(router, 12, events)
        prefix = list(range(100, 100 + 8 * BLOCK))  # 8 blocks
        first = router.route([*prefix, 1], [IDLE, IDLE])
        assert _serve(kvs[first], "p", [*prefix, 1]) == 0
        # Other prompts served by the same replica evict the prefix from its 12-block pool.
        for i in range(3):
            other = [5000 * (i + 1) + j for j in range(10 * BLOCK)]
            _serve(kvs[first], f"o{i}", other)
        assert kvs[first].get_num_cached_tokens([*prefix, 2]) == 0  # really gone
        hits_before = router.hits
        again = router.route([*prefix, 2], [IDLE, IDLE])
        results[events] = (router.hits - hits_before, again == first)
    assert results[False] == (1, True)  # the index believes replica 0 still holds it: a wrong "hit"
    assert results[True][0] == 0  # the events say nobody holds it: routed as a miss


def test_events_router_follows_clears_and_refuses_events_without_the_flag() -> None:
    router = CacheAwareRouter(2, BLOCK, use_kv_events=True)
    kvs = _replicas(router, 16, True)
    _serve(kvs[0], "a", list(range(9)))
    assert router.indexed_blocks(0) == 2
    assert kvs[0].reset_prefix_cache()
    assert router.indexed_blocks(0) == 0
    with pytest.raises(ValueError, match="use_kv_events"):
        CacheAwareRouter(2, BLOCK).apply_events(0, KVEventBatch(0.0, []))


def test_the_event_index_is_bounded_oldest_first() -> None:
    """However many hashes a publisher reports stored, a replica's index keeps the newest `capacity`."""
    from pagoda.server.routing.event_index import EventIndex

    index = EventIndex(4)
    hashes: list[bytes] = [bytes([i]) * 32 for i in range(10)]
    index.apply(KVEventBatch(0.0, [BlockStored(hashes[:6], None, [], 16, None, "CPU")]))
    index.apply(KVEventBatch(1.0, [BlockStored([hashes[2]], None, [], 16, None, "CPU")]))  # re-stored: newest
    index.apply(KVEventBatch(2.0, [BlockStored(hashes[6:7], None, [], 16, None, "CPU")]))
    assert len(index) == 4
    assert [index.match([BlockHash(h)]) for h in hashes[:7]] == [0, 0, 1, 0, 1, 1, 1]
    router = CacheAwareRouter(1, BLOCK, max_blocks_per_replica=3, use_kv_events=True)
    router.apply_events(0, KVEventBatch(0.0, [BlockStored(hashes, None, [], 16, None, "CPU")]))
    assert router.indexed_blocks(0) == 3
