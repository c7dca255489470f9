"""The `ray` backend: workers as Ray actors in a placement group, so that the ranks can span several nodes."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec
import ray
from pagoda.server.engine.executor.messages import WorkerSpec
from pagoda.server.engine.executor.worker import run_worker
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

_PLACEMENT_TIMEOUT_S = 120.0


class RayWorker:
    """The actor: runs one rank's worker loop until the driver says Shutdown."""

    def run(self, spec: bytes) -> int:
        """The worker loop (see `run_worker`); 0 when it ended on Shutdown."""
        run_worker(msgspec.json.decode(spec, type=WorkerSpec))
        return 0


class RayLauncher:
    """One actor per worker rank, each in a bundle of a PACK placement group (a node first, then the next)."""

    def __init__(self, use_gpus: bool) -> None:
        if not ray.is_initialized():
            ray.init()  # joins the cluster of RAY_ADDRESS, else starts a local one
        self._use_gpus = use_gpus
        self._actors: list[Any] = []  # ActorHandle[RayWorker]; Any: Ray's stubs do not type `.remote` calls
        self._refs: list[ray.ObjectRef[int]] = []
        self._group: PlacementGroup | None = None

    def host(self) -> str:
        """This node's address on the cluster's network."""
        address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return address

    def start(self, specs: Sequence[WorkerSpec]) -> None:
        """Reserve a bundle per worker (one GPU, or its CPU threads), then start an actor in each."""
        cpus = float(specs[0].num_threads or 1) if specs else 1.0
        bundle = {"GPU": 1.0} if self._use_gpus else {"CPU": cpus}
        self._group = placement_group([dict(bundle) for _ in specs], strategy="PACK")
        ray.get(self._group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        actor_class: Any = ray.remote(RayWorker)
        for index, spec in enumerate(specs):
            strategy = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=index)
            actor = actor_class.options(
                num_cpus=0.0 if self._use_gpus else cpus,
                num_gpus=1.0 if self._use_gpus else 0.0,
                scheduling_strategy=strategy,
            ).remote()
            self._actors.append(actor)
            self._refs.append(actor.run.remote(msgspec.json.encode(spec)))

    def failure(self) -> str | None:
        """The first actor whose loop ended (an actor that died raises from its result)."""
        if not self._refs:
            return None
        done, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        for ref in done:
            rank = self._refs.index(ref) + 1
            try:
                ray.get(ref)
            except Exception as exc:  # RayActorError and the worker's own exceptions alike
                return f"tensor-parallel worker rank {rank} (Ray actor) failed: {type(exc).__name__}: {exc}"
            return f"tensor-parallel worker rank {rank} (Ray actor) ended"
        return None

    def stop(self, timeout: float) -> None:
        """Wait for the actors' loops to return, then kill the actors and free the placement group."""
        if self._refs:
            deadline = time.monotonic() + timeout
            ray.wait(self._refs, num_returns=len(self._refs), timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill the actors and remove the placement group (idempotent; nothing is left once Ray shut down)."""
        if not ray.is_initialized():
            self._actors.clear()
            self._refs.clear()
            self._group = None
            return
        for actor in self._actors:
            ray.kill(actor)
        self._actors.clear()
        self._refs.clear()
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None
