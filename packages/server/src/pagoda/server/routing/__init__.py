"""Data-parallel routing: which engine-core replica serves a request (`--routing-policy`).

Policy only: a router sees a prompt's token ids and each replica's load, and names a replica. The front end owns
the replicas and tells the router when one lost its cache (died and restarted).
"""

from pagoda.server.routing.base import ReplicaLoad, Router, RoutingPolicyName
from pagoda.server.routing.cache_aware import CacheAwareRouter
from pagoda.server.routing.simple import LeastLoadedRouter, RoundRobinRouter, build_router

__all__ = [
    "CacheAwareRouter",
    "LeastLoadedRouter",
    "ReplicaLoad",
    "RoundRobinRouter",
    "Router",
    "RoutingPolicyName",
    "build_router",
]
