"""Children as Ray actors: placed by Ray with their CPUs and GPUs, on any node, optionally in one placement group.

Engine cores ask for `num_cpus` (and a GPU per tensor-parallel rank) wherever Ray finds them; a set of
tensor-parallel workers asks for one bundle each of a PACK placement group (one node first, then the next), so the
ranks stay together. The actor runs the program's body with the same msgpack `ChildSpec` a local child reads
from stdin, and reaches its parent over tcp:// on this node's IP. Ray owns the actors' lifetime: they die with
the driver (this process).
"""

from __future__ import annotations

import logging
import os
from typing import Any, TypeVar

import ray
from pagoda.server.procs.launch import Handle
from pagoda.server.procs.spec import ChildSpec, Program, decode_child, encode_child
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)

S = TypeVar("S")

_PLACEMENT_TIMEOUT_S = 120.0


class ChildActor:
    """The actor: runs one child's program body until it is told to stop (it blocks its one task slot)."""

    def run(self, program: Program[Any], frame: bytes) -> None:
        """Decode the `ChildSpec`, run the body; returns when the child stopped, raises if it failed."""
        child = decode_child(frame, program)
        logging.basicConfig(
            level=child.log_level, format=f"%(levelname)s %(name)s[ray {program.name}]: %(message)s"
        )
        program.run(child)


class RayHandle:
    """A child actor and the reference of its `run` task (ready once the child stopped or died)."""

    def __init__(self, actor: Any, done: ray.ObjectRef[None], name: str) -> None:
        self._actor = actor  # ActorHandle[ChildActor]; Any: Ray's stubs do not type `.remote` calls
        self._done = done
        self._name = name

    def describe(self) -> str:
        """The child's name, as a Ray actor."""
        return f"{self._name} (Ray actor)"

    def is_alive(self) -> bool:
        """True while the `run` task has not ended (nothing runs once Ray shut down)."""
        if not ray.is_initialized():
            return False
        ready, _ = ray.wait([self._done], timeout=0)
        return not ready

    def describe_exit(self) -> str:
        """How `run` ended: normally, or with the actor's error (a killed actor's death cause)."""
        if self.is_alive():
            return "still running"
        if not ray.is_initialized():
            return "ended with Ray"
        try:
            ray.get(self._done, timeout=0)
        except Exception as exc:  # RayActorError and the child's own exceptions alike
            first_line = str(exc).strip().splitlines()[:1]
            return f"failed: {type(exc).__name__}: {''.join(first_line)}"
        return "ended"

    def kill(self) -> None:
        """Kill the actor (no restart)."""
        if ray.is_initialized():
            ray.kill(self._actor, no_restart=True)

    def join(self, timeout: float) -> bool:
        """Wait for `run` to end; the actor process itself goes too."""
        if not ray.is_initialized():
            return True
        ready, _ = ray.wait([self._done], timeout=timeout)
        if ready:
            ray.kill(self._actor, no_restart=True)
        return bool(ready)


def private_ray_options() -> dict[str, Any]:
    """`ray.init`'s options when Pagoda starts Ray itself: no dashboard (an HTTP API that runs jobs), and its
    host loopback should one be started anyway. Ray (2.60) resolves a loopback node address to the node's IP and
    binds its GCS and raylets on every interface whatever it is given: token authentication (on by default,
    `RAY_AUTH_MODE`) is what guards them; see the server README's Ray section."""
    return {"include_dashboard": False, "dashboard_host": "127.0.0.1"}


def start_ray(num_cpus: int | None = None) -> bool:
    """Join the cluster RAY_ADDRESS names, else the one `ray start --head` left on this node, else start a
    private one (`private_ray_options`); True when Pagoda started it. `num_cpus` bounds a started one."""
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
        return False
    try:
        ray.init(address="auto")
        return False
    except ConnectionError:
        pass  # no cluster on this node: start one
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        logger.warning(
            "RAY_AUTH_MODE=disabled: the Ray cluster Pagoda starts accepts any peer on the network"
        )
    ray.init(num_cpus=num_cpus, **private_ray_options())
    return True


class RayLauncher:
    """Children as Ray actors of `num_cpus` CPUs and `num_gpus` GPUs each, reached over tcp:// on this node's IP.

    With `placement_group_size`, the first launch reserves a PACK placement group of that many bundles (each the
    actor's CPUs or GPUs) and child `index` runs in bundle `index`; without, Ray places each actor on its own.
    """

    def __init__(
        self, num_cpus: float, num_gpus: float, log_level: int, *, placement_group_size: int | None = None
    ) -> None:
        if not ray.is_initialized():
            start_ray()
        self._host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self._num_cpus = num_cpus
        self._num_gpus = num_gpus
        self._log_level = log_level
        self._group_size = placement_group_size
        self._group: PlacementGroup | None = None
        self._actor_class: Any = ray.remote(ChildActor)

    def host(self) -> str:
        """This node's address on the cluster's network."""
        return self._host

    def address(self, name: str) -> str:
        """A free tcp port on this node's IP (the actor may run on another node)."""
        return f"tcp://{self._host}:0"

    def launch(self, program: Program[S], spec: S, *, index: int, name: str) -> Handle:
        """Create the actor (in its bundle, when there is a placement group) and start its body."""
        options: dict[str, Any] = {"num_cpus": self._num_cpus, "num_gpus": self._num_gpus}
        if self._group_size is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self._placement_group(), placement_group_bundle_index=index
            )
        actor = self._actor_class.options(**options).remote()
        child = ChildSpec(spec, self._log_level, own_process=False)
        done = actor.run.remote(program, encode_child(child))
        logger.info("%s: Ray actor created", name)
        return RayHandle(actor, done, name)

    def _placement_group(self) -> PlacementGroup:
        """The set's placement group, reserved (and waited for) on first use."""
        if self._group is None:
            assert self._group_size is not None
            bundle = {"GPU": self._num_gpus} if self._num_gpus else {"CPU": self._num_cpus}
            self._group = placement_group([dict(bundle) for _ in range(self._group_size)], strategy="PACK")
            ray.get(self._group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        return self._group

    def close(self) -> None:
        """Free the placement group (nothing is left once Ray shut down); the actors were stopped by their handles."""
        if self._group is not None and ray.is_initialized():
            remove_placement_group(self._group)
        self._group = None
