"""The router's interface: replica loads in, a replica index out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

RoutingPolicyName = Literal["cache_aware", "least_loaded", "round_robin"]


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's load as the front end sees it when a request arrives."""

    alive: bool
    num_running: int  # from the replica's last stats
    num_waiting: int  # from the replica's last stats
    num_tokens: int  # prompt + max new tokens of requests routed there and not finished (front-end count)
    kv_cache_usage: float  # fraction of the replica's device KV blocks in use, from its last stats

    @property
    def load(self) -> tuple[int, float, int]:
        """Sort key of "less loaded first": outstanding tokens, then KV usage, then queue length."""
        return (self.num_tokens, self.kv_cache_usage, self.num_running + self.num_waiting)


class Router(Protocol):
    """Chooses a live replica for each request."""

    @property
    def hits(self) -> int:
        """Requests routed to a replica because it held their prefix (counter)."""
        ...

    @property
    def misses(self) -> int:
        """Requests routed by load because no replica held their prefix (counter)."""
        ...

    def route(
        self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad], *, salt: str | None = None
    ) -> int:
        """The index of the replica that serves this prompt; at least one of `loads` is alive. `salt` is the
        request's prefix-cache salt (`SamplingParams.cache_salt`): salted prompts share blocks only alike."""
        ...

    def reset_replica(self, replica: int) -> None:
        """Forget what replica `replica` held: it died, or restarted with an empty cache."""
        ...


def live_replicas(loads: Sequence[ReplicaLoad]) -> list[int]:
    """Indexes of the live replicas; an error when none is alive."""
    live = [i for i, load in enumerate(loads) if load.alive]
    if not live:
        raise ValueError("no replica is alive")
    return live


def least_loaded(loads: Sequence[ReplicaLoad], among: Sequence[int]) -> int:
    """The least-loaded replica of `among` (ties: the lower index)."""
    return min(among, key=lambda i: (*loads[i].load, i))
