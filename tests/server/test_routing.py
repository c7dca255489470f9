"""The routers: round robin and least loaded skip dead replicas and follow the load; cache-aware sends a prompt to the
replica holding its prefix unless that would unbalance the replicas."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagoda.blockalloc.hashing import ROOT_BLOCK_HASH, hash_blocks, salt_bytes
from pagoda.server.routing import (
    CacheAwareRouter,
    LeastLoadedRouter,
    ReplicaLoad,
    RoundRobinRouter,
    Router,
    build_router,
)


def _load(tokens: int, *, alive: bool = True, usage: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(alive=alive, num_running=0, num_waiting=0, num_tokens=tokens, kv_cache_usage=usage)


def test_round_robin_cycles_over_live_replicas() -> None:
    router = RoundRobinRouter()
    loads = [_load(0), _load(0, alive=False), _load(0)]
    assert [router.route([1], loads) for _ in range(4)] == [0, 2, 0, 2]


def test_least_loaded_prefers_fewer_tokens_then_lower_usage() -> None:
    router = LeastLoadedRouter()
    assert router.route([1], [_load(10), _load(3), _load(5)]) == 1
    assert router.route([1], [_load(3, usage=0.5), _load(3, usage=0.1)]) == 1
    assert router.route([1], [_load(0, alive=False), _load(9)]) == 1


def test_no_live_replica_is_an_error() -> None:
    with pytest.raises(ValueError, match="no replica is alive"):
        RoundRobinRouter().route([1], [_load(0, alive=False)])


def test_build_router_names_the_policy() -> None:
    assert isinstance(build_router("round_robin", 2, 16), RoundRobinRouter)
    assert isinstance(build_router("least_loaded", 2, 16), LeastLoadedRouter)
    with pytest.raises(ValueError, match="num_replicas"):
        build_router("round_robin", 0, 16)


BLOCK = 4  # tokens per KV block in the cache-aware tests: small prompts span several blocks


def _prompt(prefix: int, suffix: int, prefix_blocks: int = 4, suffix_tokens: int = 3) -> list[int]:
    """`prefix_blocks` full blocks shared by every prompt of `prefix`, then a short distinct question."""
    head = [1000 * (prefix + 1) + t for t in range(prefix_blocks * BLOCK)]
    return head + [900_000 + 10 * suffix + t for t in range(suffix_tokens)]


class _Cluster:
    """The front end's side of routing: replica loads that grow by each prompt routed there (none finish)."""

    def __init__(self, router: Router, num_replicas: int) -> None:
        self.router = router
        self.tokens = [0] * num_replicas
        self.alive = [True] * num_replicas

    def loads(self) -> list[ReplicaLoad]:
        return [_load(tokens, alive=alive) for tokens, alive in zip(self.tokens, self.alive, strict=True)]

    def send(self, prompt: list[int]) -> int:
        chosen = self.router.route(prompt, self.loads())
        assert self.alive[chosen]
        self.tokens[chosen] += len(prompt)
        return chosen


def _cache_aware(num_replicas: int = 2, **kwargs: Any) -> CacheAwareRouter:
    return CacheAwareRouter(num_replicas, BLOCK, **kwargs)


def test_shared_prefix_requests_stick_to_one_replica() -> None:
    """The first request of a prefix is a miss on the least-loaded replica; the rest follow it as hits."""
    cluster = _Cluster(_cache_aware(), 2)
    cluster.tokens = [50, 0]
    assert {cluster.send(_prompt(0, q)) for q in range(10)} == {1}
    assert (cluster.router.hits, cluster.router.misses) == (9, 1)


def test_distinct_prefixes_spread_over_the_replicas_and_come_back() -> None:
    """16 new prefixes go by load, so both replicas get some; each prefix then returns to its replica."""
    cluster = _Cluster(_cache_aware(), 2)
    first = [cluster.send(_prompt(p, 0)) for p in range(16)]
    assert first.count(0) >= 4 and first.count(1) >= 4
    assert [cluster.send(_prompt(p, 1)) for p in range(16)] == first
    assert (cluster.router.hits, cluster.router.misses) == (16, 16)


def test_new_prefixes_spread_when_requests_arrive_one_at_a_time() -> None:
    """Every load 0 (each request finished before the next): a new prefix goes to the smaller index, as SGLang
    sends a miss to the smallest tree, so prefixes alternate instead of piling on replica 0."""
    router = _cache_aware()
    idle = [_load(0), _load(0)]
    assert [router.route(_prompt(p, 0), idle) for p in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [router.route(_prompt(p, 1), idle) for p in range(6)] == [0, 1, 0, 1, 0, 1]
    assert (router.hits, router.misses) == (6, 6)


def test_a_match_under_the_cache_threshold_routes_by_load() -> None:
    """Two of eight blocks matching (0.25 < 0.5) is not enough: the request goes by load and counts a miss."""
    cluster = _Cluster(_cache_aware(), 2)
    assert cluster.send(_prompt(0, 0, prefix_blocks=2)) == 0
    longer = _prompt(0, 0, prefix_blocks=2, suffix_tokens=0) + list(range(6 * BLOCK))
    assert cluster.send(longer) == 1
    assert (cluster.router.hits, cluster.router.misses) == (0, 2)
    assert cluster.send([*longer, 7]) == 1  # now replica 1 holds all eight blocks
    assert cluster.router.hits == 1


def test_the_balance_threshold_diverts_a_hot_prefix() -> None:
    """Once the prefix's replica is far and relatively ahead, requests go to the idle one, as misses."""
    cluster = _Cluster(_cache_aware(balance_abs_threshold=100, balance_rel_threshold=1.5), 2)
    prompt_len = len(_prompt(0, 0))  # 19 tokens
    chosen = [cluster.send(_prompt(0, q)) for q in range(8)]
    # Replica 0 takes the prefix until it is over 100 tokens ahead: 6 prompts (114 tokens); the 7th is diverted.
    assert chosen[:7] == [0] * 6 + [1]
    assert (cluster.router.hits, cluster.router.misses) == (6, 2)
    assert cluster.tokens[0] == 6 * prompt_len
    # Balanced again and both hold the prefix: the longest match ties, so the less loaded replica wins, as a hit.
    assert chosen[7] == 1


def test_lru_eviction_forgets_the_least_recently_used_prefix() -> None:
    """Capacity 8 blocks holds two 4-block prefixes; a third evicts the one touched least recently."""
    router = _cache_aware(1, max_blocks_per_replica=8)
    cluster = _Cluster(router, 1)
    for prefix in (
        0,
        1,
        0,
        2,
    ):  # prefix 0 is touched again before prefix 2 arrives, so prefix 1 is the oldest
        cluster.send(_prompt(prefix, 0, suffix_tokens=0))
    assert router.indexed_blocks(0) == 8
    assert (router.hits, router.misses) == (1, 3)
    cluster.send(_prompt(0, 1, suffix_tokens=0))
    assert (router.hits, router.misses) == (2, 3)
    cluster.send(_prompt(1, 1, suffix_tokens=0))
    assert (router.hits, router.misses) == (2, 4)


def test_eviction_trims_a_chain_from_its_tail() -> None:
    """A shared prefix's leading blocks are the most recent, so eviction takes its last blocks first."""
    router = _cache_aware(1, max_blocks_per_replica=6)
    cluster = _Cluster(router, 1)
    cluster.send(_prompt(0, 0, prefix_blocks=4, suffix_tokens=0))
    cluster.send(_prompt(1, 0, prefix_blocks=4, suffix_tokens=0))  # keeps prefix 0's first two blocks only
    assert router.indexed_blocks(0) == 6
    # 2 of 4 blocks still match, the default threshold of half: a hit (had the head gone, nothing would match).
    cluster.send(_prompt(0, 0, prefix_blocks=4, suffix_tokens=0))
    assert (router.hits, router.misses) == (1, 2)


def test_reset_replica_forgets_its_prefixes() -> None:
    """After reset_replica the prefix is new again: a miss, routed by load."""
    cluster = _Cluster(_cache_aware(), 2)
    holder = cluster.send(_prompt(0, 0))
    cluster.router.reset_replica(holder)
    cluster.tokens = [0, 0]
    cluster.tokens[holder] = 10
    assert cluster.send(_prompt(0, 1)) == 1 - holder
    assert (cluster.router.hits, cluster.router.misses) == (0, 2)
    assert isinstance(cluster.router, CacheAwareRouter) and cluster.router.indexed_blocks(holder) == 0


def test_dead_replicas_are_never_chosen() -> None:
    """A dead replica holding the prefix is skipped; the request goes to a live one by load, as a miss."""
    cluster = _Cluster(_cache_aware(3), 3)
    cluster.tokens = [0, 40, 30]
    assert cluster.send(_prompt(0, 0)) == 0
    cluster.alive[0] = False
    assert cluster.send(_prompt(0, 1)) == 2
    assert cluster.send(_prompt(0, 2)) == 2
    assert (cluster.router.hits, cluster.router.misses) == (1, 2)
    with pytest.raises(ValueError, match="no replica is alive"):
        cluster.router.route(_prompt(0, 3), [_load(0, alive=False)] * 3)


def test_prompts_shorter_than_one_block_route_by_load() -> None:
    """A prompt without a full block has nothing to match: by load every time, and every time a miss."""
    cluster = _Cluster(_cache_aware(), 2)
    short = [5] * (BLOCK - 1)
    assert [cluster.send(short) for _ in range(4)] == [0, 1, 0, 1]
    assert (cluster.router.hits, cluster.router.misses) == (0, 4)
    assert isinstance(cluster.router, CacheAwareRouter) and cluster.router.indexed_blocks(0) == 0


def test_the_index_holds_the_engines_block_hashes() -> None:
    """The router keys its index by the prefix cache's own chained block hashes (full blocks only)."""
    router = _cache_aware(1)
    prompt = list(range(2 * BLOCK + 3))
    router.route(prompt, [_load(0)])
    assert router.indexed_blocks(0) == 2
    engine_hashes = hash_blocks(prompt, BLOCK, 0, 2, ROOT_BLOCK_HASH, salt_bytes(None))
    assert router._indexes[0].match(engine_hashes) == 2


def test_build_router_builds_the_cache_aware_router_with_its_tuning() -> None:
    """cache_aware takes SGLang's thresholds and the index capacity as keywords; bad values are refused."""
    router = build_router("cache_aware", 2, 16, cache_threshold=0.2, max_blocks_per_replica=64)
    assert isinstance(router, CacheAwareRouter)
    assert (router.block_size, router.cache_threshold) == (16, 0.2)
    for kwargs in ({"cache_threshold": 1.5}, {"balance_rel_threshold": 0.5}, {"max_blocks_per_replica": 0}):
        with pytest.raises(ValueError):
            build_router("cache_aware", 2, 16, **kwargs)
    with pytest.raises(ValueError, match="replica loads"):
        router.route([1], [_load(0)])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=40),
    st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=1, max_size=40),
)
def test_routing_invariants(sends: list[tuple[int, int, int]], alive: list[list[bool]]) -> None:
    """Any traffic: a live replica is chosen, every request counts once, no index outgrows its capacity."""
    router = _cache_aware(3, max_blocks_per_replica=10)
    cluster = _Cluster(router, 3)
    for step, (prefix, question, blocks) in enumerate(sends):
        flags = alive[step % len(alive)]
        cluster.alive = flags if any(flags) else [True, False, False]
        cluster.send(_prompt(prefix, question, prefix_blocks=blocks))
        assert all(router.indexed_blocks(r) <= 10 for r in range(3))
    assert router.hits + router.misses == len(sends)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=30))
def test_hits_count_exactly_the_prefixes_seen_before(sends: list[tuple[int, int]]) -> None:
    """One replica, threshold 0: a request is a hit exactly when its first block was routed before."""
    router = _cache_aware(1, cache_threshold=0.0)
    cluster = _Cluster(router, 1)
    seen: set[int] = set()
    expected_hits = 0
    for prefix, question in sends:
        expected_hits += prefix in seen
        seen.add(prefix)
        cluster.send(_prompt(prefix, question))
    assert (router.hits, router.misses) == (expected_hits, len(sends) - expected_hits)
