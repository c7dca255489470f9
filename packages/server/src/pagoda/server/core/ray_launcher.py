"""Engine cores as Ray actors: each replica placed by Ray with its CPUs (and GPUs), on any node of the cluster.

The actor runs the same `serve_core` loop as a local core process and connects to the front end's tcp://
sockets, so one transport serves both. Ray owns the actors' lifetime: they die with the driver (the front end).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import ray
from pagoda.server.core.engine_core import CoreSpec, serve_core
from pagoda.server.core.launchers import CoreHandle

logger = logging.getLogger(__name__)


class EngineCoreActor:
    """A Ray actor whose `run` serves one engine core until `Shutdown` (it blocks its one task slot)."""

    def run(self, spec_frame: bytes, log_level: int) -> None:
        """Serve the core of a msgpack `CoreSpec`; returns when it stops, raises if it failed."""
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s[ray core]: %(message)s")
        serve_core(msgspec.msgpack.decode(spec_frame, type=CoreSpec), handle_signals=False)


class _ActorHandle:
    """A core actor and the reference of its `run` task (ready once the core stopped or died)."""

    def __init__(self, actor: Any, done: ray.ObjectRef[None]) -> None:
        self._actor = actor
        self._done = done

    def is_alive(self) -> bool:
        """True while the `run` task has not ended."""
        ready, _ = ray.wait([self._done], timeout=0)
        return not ready

    def describe_exit(self) -> str:
        """How `run` ended: normally, or the actor's error (a killed actor's death cause)."""
        if self.is_alive():
            return "still running"
        try:
            ray.get(self._done, timeout=0)
        except Exception as exc:
            return f"Ray actor died: {type(exc).__name__}"
        return "exited"

    def kill(self) -> None:
        """Kill the actor (no restart)."""
        ray.kill(self._actor, no_restart=True)

    def join(self, timeout: float) -> bool:
        """Wait for `run` to end."""
        ready, _ = ray.wait([self._done], timeout=timeout)
        if ready:
            ray.kill(self._actor, no_restart=True)  # the actor process itself goes too
        return bool(ready)


class RayLauncher:
    """Cores as Ray actors of `num_cpus` CPUs and `num_gpus` GPUs each, reached over tcp:// on this node's IP."""

    def __init__(self, num_cpus: float, num_gpus: float, log_level: int) -> None:
        if not ray.is_initialized():
            # Ray's own lookup: RAY_ADDRESS, else the cluster `ray start --head` left on this node, else a new
            # local one.
            ray.init()
        self._host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self._actor_class = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(EngineCoreActor)
        self._log_level = log_level

    def address(self, index: int, generation: int, channel: str) -> str:
        """A free tcp port on this node's IP (the actor may run on another node)."""
        return f"tcp://{self._host}:0"

    def launch(self, index: int, spec: CoreSpec) -> CoreHandle:
        """Create the actor and start its core."""
        actor: Any = self._actor_class.remote()  # Ray's actor handles are dynamically typed
        done = actor.run.remote(msgspec.msgpack.encode(spec), self._log_level)
        logger.info("engine core %d: Ray actor created", index)
        return _ActorHandle(actor, done)

    def close(self) -> None:
        """Nothing to release: the actors were killed by their handles."""
