"""The cache-aware router and the host KV tier's events (issue 39): a block any replica stored in the shared tier
(medium CPU_TIER) is a lesser hit for every replica, the device's own blocks still win, an unbroken run counts,
and neither a replica's cache reset nor its restart empties the tier's index."""

from __future__ import annotations

from pagoda.blockalloc.hashing import ROOT_BLOCK_HASH, BlockHash, hash_blocks, salt_bytes
from pagoda.server.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagoda.server.kv_events.wire import HOST_TIER_MEDIUM
from pagoda.server.routing import CacheAwareRouter, ReplicaLoad
from pagoda.server.routing.cache_aware import TIER_HIT_WEIGHT

BLOCK = 4
PREFIX = list(range(100, 100 + 8 * BLOCK))  # 8 full blocks
PROMPT = [*PREFIX, 1]


def load(num_tokens: int) -> ReplicaLoad:
    """A live replica with `num_tokens` outstanding tokens."""
    return ReplicaLoad(alive=True, num_running=0, num_waiting=0, num_tokens=num_tokens, kv_cache_usage=0.0)


def hashes(tokens: list[int] = PREFIX) -> list[BlockHash]:
    """The chained hashes of the full blocks of `tokens` (unsalted)."""
    return hash_blocks(tokens, BLOCK, 0, len(tokens) // BLOCK, ROOT_BLOCK_HASH, salt_bytes(None))


def stored(block_hashes: list[BlockHash], medium: str) -> KVEventBatch:
    """One BlockStored of `medium`."""
    return KVEventBatch(0.0, [BlockStored(list(block_hashes), None, [], BLOCK, None, medium)])


def removed(block_hashes: list[BlockHash], medium: str) -> KVEventBatch:
    """One BlockRemoved of `medium`."""
    return KVEventBatch(0.0, [BlockRemoved(list(block_hashes), medium)])


def test_a_prefix_only_the_tier_holds_is_a_hit_on_every_replica_routed_by_load() -> None:
    """Replica 0 stored the prefix in the tier and lost its device copy: the prompt is a hit on both replicas
    (the less loaded one serves it); without the tier's events it would be a miss."""
    for with_tier in (False, True):
        router = CacheAwareRouter(2, BLOCK, use_kv_events=True)
        if with_tier:
            router.apply_events(0, stored(hashes(), HOST_TIER_MEDIUM))
        assert router.indexed_blocks(0) == router.indexed_blocks(1) == 0  # no device index took them
        assert router.tier_blocks() == (8 if with_tier else 0)
        chosen = router.route(PROMPT, [load(100), load(0)])
        assert (router.hits, router.misses, router.tier_hits) == ((1, 0, 1) if with_tier else (0, 1, 0))
        if with_tier:
            assert chosen == 1  # the less loaded: the tier serves both alike
            assert router.route(PROMPT, [load(0), load(100)]) == 0


def test_the_device_copy_outweighs_the_tier() -> None:
    """Replica 1 holds 4 blocks on its device, the tier all 8: replica 1 scores 4 + 0.5 * 4 against replica 0's
    0.5 * 8, so it wins even when busier; once replica 0 holds all 8 on its device, replica 0 wins."""
    assert 4 + TIER_HIT_WEIGHT * 4 > TIER_HIT_WEIGHT * 8
    router = CacheAwareRouter(2, BLOCK, use_kv_events=True)
    router.apply_events(0, stored(hashes(), HOST_TIER_MEDIUM))
    router.apply_events(1, stored(hashes()[:4], "CPU"))
    assert router.route(PROMPT, [load(0), load(1000)]) == 1
    router.apply_events(0, stored(hashes(), "CPU"))
    assert router.route(PROMPT, [load(1000), load(0)]) == 0
    assert router.hits == 2 and router.tier_hits == 1  # the second needed no tier block


def test_only_an_unbroken_run_of_tier_blocks_counts() -> None:
    """The tier evicts by set, not by chain: with block 3 missing only 3 blocks are loadable, under the
    threshold of half the prompt (a miss); with block 3 back, all 8."""
    router = CacheAwareRouter(2, BLOCK, use_kv_events=True)
    chain = hashes()
    router.apply_events(0, stored([*chain[:3], *chain[4:]], HOST_TIER_MEDIUM))
    router.route(PROMPT, [load(0), load(0)])
    assert (router.hits, router.misses) == (0, 1)
    router.apply_events(1, stored([chain[3]], HOST_TIER_MEDIUM))  # another replica's store: the same tier
    router.route(PROMPT, [load(0), load(0)])
    assert (router.hits, router.tier_hits) == (1, 1)


def test_a_tier_block_another_replica_evicted_is_gone() -> None:
    """Replica 0 stored the prefix, replica 1's later stores evicted its first block: no replica can load it."""
    router = CacheAwareRouter(2, BLOCK, use_kv_events=True)
    router.apply_events(0, stored(hashes(), HOST_TIER_MEDIUM))
    router.apply_events(1, removed(hashes()[:1], HOST_TIER_MEDIUM))
    assert router.tier_blocks() == 7
    router.route(PROMPT, [load(0), load(0)])
    assert (router.hits, router.misses) == (0, 1)


def test_device_clears_and_restarts_keep_the_tier() -> None:
    """AllBlocksCleared (a replica's prefix-cache reset) and reset_replica (it restarted) empty that replica's
    device index only: the shared tier outlives both, and its removals never touch a device index."""
    router = CacheAwareRouter(2, BLOCK, use_kv_events=True)
    router.apply_events(0, stored(hashes(), "CPU"))
    router.apply_events(0, stored(hashes(), HOST_TIER_MEDIUM))
    router.apply_events(0, removed(hashes()[:2], HOST_TIER_MEDIUM))
    assert router.indexed_blocks(0) == 8 and router.tier_blocks() == 6
    router.apply_events(0, KVEventBatch(0.0, [AllBlocksCleared()]))
    assert router.indexed_blocks(0) == 0 and router.tier_blocks() == 6
    router.apply_events(1, stored(hashes()[:2], HOST_TIER_MEDIUM))
    router.reset_replica(1)
    assert router.tier_blocks() == 8
    router.route(PROMPT, [load(0), load(0)])
    assert router.tier_hits == 1


def test_without_kv_events_there_is_no_tier_index() -> None:
    """The approximate (routed-prompts) index knows nothing of tiers: scores are its device matches."""
    router = CacheAwareRouter(2, BLOCK)
    assert router.tier_blocks() == 0
    first = router.route(PROMPT, [load(0), load(0)])
    assert router.route(PROMPT, [load(0), load(0)]) == first and router.hits == 1 and router.tier_hits == 0
