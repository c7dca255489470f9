"""The prompt-blind routers: round robin and least loaded skip dead replicas and follow the load."""

from __future__ import annotations

import pytest
from pagoda.server.routing import LeastLoadedRouter, ReplicaLoad, RoundRobinRouter, build_router


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
