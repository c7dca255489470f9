"""The routers that ignore prompts: round robin and least loaded, and `build_router`."""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.server.routing.base import ReplicaLoad, Router, RoutingPolicyName


def _live(loads: Sequence[ReplicaLoad]) -> list[int]:
    live = [i for i, load in enumerate(loads) if load.alive]
    if not live:
        raise ValueError("no replica is alive")
    return live


class RoundRobinRouter:
    """Each request to the next live replica in turn."""

    def __init__(self) -> None:
        self._next = 0
        self.hits = 0  # never routes by prefix
        self.misses = 0

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        """The next live replica after the last one chosen."""
        live = _live(loads)
        chosen = next((i for i in live if i >= self._next), live[0])
        self._next = chosen + 1
        return chosen

    def reset_replica(self, replica: int) -> None:
        """Nothing to forget."""


class LeastLoadedRouter:
    """Each request to the live replica with the fewest outstanding tokens (ties: lower KV usage, index)."""

    def __init__(self) -> None:
        self.hits = 0  # never routes by prefix
        self.misses = 0

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        """The least-loaded live replica."""
        return min(_live(loads), key=lambda i: (*loads[i].load, i))

    def reset_replica(self, replica: int) -> None:
        """Nothing to forget."""


def build_router(policy: RoutingPolicyName, num_replicas: int, block_size: int) -> Router:
    """The router `--routing-policy` names, for `num_replicas` replicas with KV blocks of `block_size` tokens."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    if policy == "round_robin":
        return RoundRobinRouter()
    if policy == "least_loaded":
        return LeastLoadedRouter()
    # cache_aware: the prefix-aware router is built by the routing helper (pagoda.server.routing.cache_aware).
    raise ValueError(f"routing policy {policy!r} is not available yet")
