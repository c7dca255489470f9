"""The routers that ignore prompts: round robin and least loaded, and `build_router`."""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.server.routing.base import ReplicaLoad, Router, RoutingPolicyName, least_loaded, live_replicas
from pagoda.server.routing.cache_aware import (
    DEFAULT_BALANCE_ABS_THRESHOLD,
    DEFAULT_BALANCE_REL_THRESHOLD,
    DEFAULT_CACHE_THRESHOLD,
    DEFAULT_MAX_BLOCKS_PER_REPLICA,
    CacheAwareRouter,
)


class RoundRobinRouter:
    """Each request to the next live replica in turn."""

    def __init__(self) -> None:
        self._next = 0
        self.hits = 0  # never routes by prefix
        self.misses = 0

    def route(
        self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad], *, salt: str | None = None
    ) -> int:
        """The next live replica after the last one chosen."""
        live = live_replicas(loads)
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

    def route(
        self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad], *, salt: str | None = None
    ) -> int:
        """The least-loaded live replica."""
        return least_loaded(loads, live_replicas(loads))

    def reset_replica(self, replica: int) -> None:
        """Nothing to forget."""


def build_router(
    policy: RoutingPolicyName,
    num_replicas: int,
    block_size: int,
    *,
    max_blocks_per_replica: int | None = None,
    cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
    balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
    balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
    use_kv_events: bool = False,
) -> Router:
    """The router `--routing-policy` names, for `num_replicas` replicas with KV blocks of `block_size` tokens.

    The keyword arguments tune cache_aware only: `max_blocks_per_replica` bounds each replica's prefix index (pass
    a replica's KV capacity in blocks; None: DEFAULT_MAX_BLOCKS_PER_REPLICA), the thresholds are SGLang's;
    `use_kv_events` indexes what the replicas' KV cache events report instead (`CacheAwareRouter.apply_events`).
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    if policy == "round_robin":
        return RoundRobinRouter()
    if policy == "least_loaded":
        return LeastLoadedRouter()
    if policy == "cache_aware":
        return CacheAwareRouter(
            num_replicas,
            block_size,
            cache_threshold=cache_threshold,
            balance_abs_threshold=balance_abs_threshold,
            balance_rel_threshold=balance_rel_threshold,
            max_blocks_per_replica=(
                DEFAULT_MAX_BLOCKS_PER_REPLICA if max_blocks_per_replica is None else max_blocks_per_replica
            ),
            use_kv_events=use_kv_events,
        )
    raise ValueError(f"unknown routing policy {policy!r}")
