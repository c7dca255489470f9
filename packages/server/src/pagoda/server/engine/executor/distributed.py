"""Tensor parallelism: the driver (rank 0, in the engine's process) and N - 1 workers, one shard each.

Each step the driver sends the SchedulerOutput to every worker (msgspec over ZeroMQ), then all ranks run the
same forward; the layers' collectives keep them in lockstep. Logits are gathered to the driver, which alone
samples: the sampler's state (seeded streams, grammar matchers, penalties, beams) lives in the engine, the next
step's SchedulerOutput carries the sampled tokens to the workers anyway, and a gather moves 1/N of what an
all-gather (every rank sampling with the same keys) would.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Self, TypeVar

import msgspec
import torch
import zmq
from pagoda.scheduler import SchedulerOutput
from pagoda.server.config import EngineConfig
from pagoda.server.engine.executor.base import Executor, ExecutorError
from pagoda.server.engine.executor.comm import ProcessGroupCollectives, make_file_store, make_store
from pagoda.server.engine.executor.messages import (
    Command,
    ComputeLogits,
    Execute,
    FFNCommand,
    RankSleepState,
    Sleep,
    Start,
    WakeUp,
    WorkerReady,
    WorkerRole,
    WorkerSpec,
)
from pagoda.server.engine.executor.worker import WORKER_PROGRAM
from pagoda.server.engine.model_runner import ModelRunner, PromptHidden
from pagoda.server.engine.setup import (
    EngineConfigError,
    EngineParts,
    Placement,
    build_parts,
    dtype_name,
    select_placement,
    with_lora,
)
from pagoda.server.loader import resolve_model_folder
from pagoda.server.lora.manager import LoRAManager
from pagoda.server.models import TensorParallelError
from pagoda.server.models.parallel import ParallelGroup, check_tensor_parallel
from pagoda.server.procs import (
    FrameDecoder,
    Handle,
    Launcher,
    ProcessLauncher,
    Shutdown,
    bind,
    local_path,
    stop_children,
)
from pagoda.server.procs.security import Authenticator, LaunchKeys, PeerKeys, serve_securely, token_matches
from torch import Tensor
from torch._C._distributed_c10d import Store, TCPStore
from transformers import AutoConfig

logger = logging.getLogger("pagoda.engine")
_STARTUP_TIMEOUT_S = 900.0  # loading a large shard; a worker that dies meanwhile is noticed within a poll
_POLL_MS = 200
_STOP_TIMEOUT_S = 10.0
_SLEEP_TIMEOUT_S = 900.0  # a wake reads the shard back from its checkpoint, as long as a start's load


def model_folder(config: EngineConfig) -> Path:
    """The model's folder, resolved once by the driver (its workers are told it)."""
    cache_dir = config.model_config.cache_dir
    return resolve_model_folder(config.model_config.model, None if cache_dir is None else Path(cache_dir))


def _launcher(config: EngineConfig, workers: int, use_gpus: bool, threads: int | None) -> Launcher:
    """The configured backend's launcher for `workers` ranks 1..N-1 (Ray is imported only when asked for).

    Ray: one bundle per worker in a PACK placement group, one GPU each on CUDA, else its torch threads' CPUs.
    mp: local processes, not pinned (each runs `threads` torch threads).
    """
    if config.parallel_config.distributed_executor_backend == "ray":
        from pagoda.server.procs.ray_launcher import RayLauncher

        cpus = 0.0 if use_gpus else float(threads or 1)
        gpus = 1.0 if use_gpus else 0.0
        return RayLauncher(cpus, gpus, logging.WARNING, placement_group_size=workers)
    return ProcessLauncher(workers, logging.WARNING, pin=False)


def threads_per_rank(size: int) -> int:
    """Torch threads of each CPU rank: the cores this process may use, shared evenly (1 on 2 cores for TP=2)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // size)


class _RankAnswer(Protocol):
    """A worker's reply that names its rank."""

    @property
    def rank(self) -> int:
        """The worker's rank."""
        ...


_Answer = TypeVar("_Answer", bound=_RankAnswer)


class DistributedExecutor(Executor):
    """Drives N - 1 workers from the engine's process, which runs rank 0; see `launch`."""

    def __init__(
        self,
        driver: ModelRunner,
        group: ProcessGroupCollectives,
        launcher: Launcher,
        workers: list[Handle],
        context: zmq.Context[zmq.Socket[bytes]],
        authenticator: Authenticator,
        router: zmq.Socket[bytes],
        identities: list[bytes],
        restore_threads: int | None,
        lora: LoRAManager | None = None,
        shard: ProcessGroupCollectives | None = None,
    ) -> None:
        """`lora`: the driver's adapter slots, whose step adapters every worker is told to hold (None: no LoRA);
        `shard`: the group the driver's model is sharded over when it is not `group` (AFD's attention ranks)."""
        self.driver = driver
        self.lora = lora
        self.shard = shard
        self.num_blocks = driver.kv_cache.num_blocks
        self.num_host_blocks = driver.kv_cache.num_host_blocks
        self.group = group
        self.launcher = launcher
        self.workers = workers  # ranks 1..N-1, in order
        self._router = router
        self._context = context
        self._authenticator = authenticator
        self._identities = identities  # ranks 1..N-1: the sockets that sent this launch's Ready
        self._restore_threads = restore_threads
        self._failed: ExecutorError | None = None
        self._stopped = False
        self.steps = 0  # steps executed (the benchmark divides the collective time by it)
        # Workers must not outlive an engine that was never shut down (a test that failed, an interpreter exit).
        self._finalizer = weakref.finalize(self, _release, workers, launcher)

    @classmethod
    def launch(cls, config: EngineConfig) -> tuple[DistributedExecutor, EngineParts]:
        """Start the workers, load rank 0's shard beside them, agree on the KV size, form the process group."""
        size = config.parallel_config.tensor_parallel_size
        folder = model_folder(config)
        try:
            check_tensor_parallel(AutoConfig.from_pretrained(folder).get_text_config(), size)
        except TensorParallelError as exc:
            raise EngineConfigError(str(exc)) from exc
        return cls.start(config, folder, ["tensor_parallel"] * (size - 1))

    @classmethod
    def shard_of(
        cls, config: EngineConfig, world: ProcessGroupCollectives
    ) -> tuple[ProcessGroupCollectives | None, str]:
        """The group the driver's model is sharded over (None: unsplit) and its store prefix, when it is not the
        world's: tensor parallelism shards over every rank."""
        return world, ""

    @classmethod
    def driver_parts(
        cls, config: EngineConfig, group: ProcessGroupCollectives | None, placement: Placement
    ) -> EngineParts:
        """The driver's model and KV cache: rank 0's shard (loaded while the workers load theirs)."""
        return with_lora(config, build_parts(config, group, placement))

    @classmethod
    def start(
        cls, config: EngineConfig, folder: Path, roles: Sequence[WorkerRole]
    ) -> tuple[Self, EngineParts]:
        """Launch ranks 1..len(roles) in their roles, build the driver's parts beside them, agree on the KV size,
        form the process group of every rank (and the driver's shard group, `shard_of`)."""
        size = len(roles) + 1
        placement = select_placement(config)
        use_gpus = placement.device.type == "cuda"
        threads = None if use_gpus else threads_per_rank(size)
        launcher = _launcher(config, size - 1, use_gpus, threads)
        host = launcher.host()
        keys = LaunchKeys.new()
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        authenticator = Authenticator(context)
        authenticator.allow(keys)
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        serve_securely(router, keys)
        address = bind(router, launcher.address("driver"))  # ipc:// locally, the node's IP under Ray
        # Local workers meet in a file of the launcher's private folder: no TCPStore, which would listen on
        # every interface whatever host it is given.
        store_path = local_path(launcher, "store")
        store: Store = (
            make_store(host, 0, size, is_master=True)
            if store_path is None
            else make_file_store(store_path, size)
        )
        port = store.port if isinstance(store, TCPStore) else 0
        endpoint = _Endpoint(address, host, port, store_path, keys.peer)
        specs = _worker_specs(config, folder, placement, endpoint, threads, roles)
        restore = torch.get_num_threads() if threads is not None else None
        workers: list[Handle] = []
        try:
            for spec in specs:
                name = f"{spec.role.replace('_', '-')} worker rank {spec.rank}"
                workers.append(launcher.launch(WORKER_PROGRAM, spec, index=spec.rank - 1, name=name))
            if threads is not None:
                torch.set_num_threads(threads)
            group = ProcessGroupCollectives(0, size)
            shard, prefix = cls.shard_of(config, group)
            parts = cls.driver_parts(config, shard, placement)
            identities = _wait_ready(router, workers, keys.peer)
            start = msgspec.msgpack.encode(Start(parts.kv_cache.num_blocks, parts.kv_cache.num_host_blocks))
            for identity in identities:
                router.send_multipart([identity, start])
            group.connect(store, placement.device, host)
            if shard is not None and shard is not group:
                shard.connect(store, placement.device, host, prefix=prefix)
        except BaseException:
            _release(workers, launcher)
            router.close()
            authenticator.stop()
            context.term()
            if restore is not None:
                torch.set_num_threads(restore)
            raise
        logger.info(
            "%s: %d ranks over %s (%s backend)%s",
            " and ".join(dict.fromkeys(role.replace("_", " ") for role in roles)),
            size,
            "NCCL" if use_gpus else "gloo",
            config.parallel_config.distributed_executor_backend,
            "" if threads is None else f", {threads} torch thread(s) per rank",
        )
        return cls(
            parts.runner(),
            group,
            launcher,
            workers,
            context,
            authenticator,
            router,
            identities,
            restore,
            parts.lora,
            None if shard is group else shard,
        ), parts

    def execute(
        self, output: SchedulerOutput, prompt_lens: Mapping[str, int]
    ) -> tuple[Tensor, dict[str, PromptHidden]]:  # ([num_rows, vocab], request id -> prompt hidden states)
        """Send the step to the workers, run rank 0's part; the logits are gathered here."""
        lora = self.lora
        self._send(Execute(output, () if lora is None else lora.requests_for(output.scheduled)))
        self.steps += 1
        try:
            return self.driver.execute(output, prompt_lens)
        except RuntimeError as exc:
            raise self._fail(exc) from exc

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [num_rows, vocab] from [num_rows, hidden_size]
        """Broadcast the hidden states; every rank scores its run of the vocabulary; rank 0 gathers."""
        self._send(ComputeLogits(hidden.shape[0], hidden.shape[1]))
        try:
            return self.driver.compute_logits(self.group.broadcast(hidden.contiguous()))
        except RuntimeError as exc:
            raise self._fail(exc) from exc

    def collective_seconds(self) -> float:
        """Wall time rank 0 spent in all-reduces, gathers and broadcasts (waiting for slower ranks included)."""
        return self.group.seconds

    def check_health(self) -> None:
        """Raise the executor's ExecutorError once a worker has ended (it names the rank)."""
        if self._failed is not None:
            raise self._failed
        if (failure := self.failure()) is not None:
            raise self._fail(None, failure)

    def shard_group(self) -> ParallelGroup | None:
        """Rank 0's group: sleep mode reads the driver's shard back with it."""
        return self.group

    def send_sleep(self, level: int) -> None:
        """Every worker frees its KV pool and releases its shard's weights (answers come in `wait_sleep_states`)."""
        self._send(Sleep(level))

    def send_wake(self, tags: Sequence[str]) -> None:
        """Every worker wakes what `tags` name (its shard read back from the checkpoint, its pool allocated)."""
        self._send(WakeUp(tuple(tags)))

    def wait_sleep_states(self) -> Sequence[RankSleepState]:
        """Every worker's answer to the last Sleep / WakeUp, by rank; ExecutorError naming a worker that ended."""
        return self._gather_answers(RankSleepState, _SLEEP_TIMEOUT_S, "no sleep-mode answer")

    def _gather_answers(
        self, kind: type[_Answer], timeout_s: float, missing: str, ranks: Sequence[int] | None = None
    ) -> list[_Answer]:
        """One `kind` answer from every worker (or those of `ranks`), by rank: ExecutorError naming a worker that
        ended meanwhile, or a TimeoutError (`missing`, with how many ranks are silent) once `timeout_s` passed."""
        decoder = msgspec.msgpack.Decoder(kind)
        answers: dict[int, _Answer] = {}
        identities = self._identities_of(ranks)
        deadline = time.monotonic() + timeout_s
        while len(answers) < len(identities):
            if self._router.poll(_POLL_MS):
                identity, payload = self._router.recv_multipart()[:2]
                if identity in identities:
                    answer = decoder.decode(payload)
                    answers[answer.rank] = answer
                continue
            self.check_health()
            if time.monotonic() > deadline:
                silent = len(identities) - len(answers)
                raise self._fail(TimeoutError(f"{missing} from {silent} rank(s)"))
        return [answers[rank] for rank in sorted(answers)]

    def failure(self) -> str | None:
        """The first worker that ended, with how it ended ("... rank 1 (pid 42) exited with -9 ..."), or None."""
        return _first_failure(self.workers)

    def _send(self, command: Command | FFNCommand, ranks: Sequence[int] | None = None) -> None:
        """The same command to every worker (or those of `ranks`), once all are known to run."""
        self.check_health()
        payload = msgspec.msgpack.encode(command)
        for identity in self._identities_of(ranks):
            self._router.send_multipart([identity, payload])

    def _identities_of(self, ranks: Sequence[int] | None) -> list[bytes]:
        """The control sockets of the workers of `ranks` (None: all)."""
        return list(self._identities) if ranks is None else [self._identities[rank - 1] for rank in ranks]

    def _fail(self, exc: BaseException | None, failure: str | None = None) -> ExecutorError:
        """The error every later call raises too, naming the worker that ended when there is one."""
        deadline = time.monotonic() + 2.0
        while failure is None and time.monotonic() < deadline:  # a killed peer may not be reaped yet
            failure = self.failure()
            time.sleep(0.05)
        reason = failure or f"a collective failed: {exc}"
        self._failed = ExecutorError(f"the tensor-parallel engine cannot continue: {reason}")
        logger.error("%s", self._failed)
        return self._failed

    def shutdown(self) -> None:
        """Tell the workers to exit, wait for them (then kill), close the sockets; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        healthy = self._failed is None and self.failure() is None
        if healthy:
            payload = msgspec.msgpack.encode(Shutdown())
            for identity in self._identities:
                self._router.send_multipart([identity, payload])
        # After a failure the surviving workers may sit in a collective that will never complete: kill them now.
        stop_children(self.workers, _STOP_TIMEOUT_S if healthy else 0.0)
        self._finalizer()
        self._router.close()
        self._authenticator.stop()
        self._context.term()
        if self._restore_threads is not None:
            torch.set_num_threads(self._restore_threads)


@dataclass(frozen=True, slots=True)
class _Endpoint:
    """Where the workers reach the driver and each other, and the launch's keys."""

    address: str  # the driver's ROUTER socket
    host: str  # the store's host (Ray) and the address gloo binds
    port: int  # the TCPStore's port (Ray); 0 with a FileStore
    store_path: str | None  # the FileStore of local workers
    keys: PeerKeys


def _worker_specs(
    config: EngineConfig,
    folder: Path,
    placement: Placement,
    endpoint: _Endpoint,
    threads: int | None,
    roles: Sequence[WorkerRole],
) -> list[WorkerSpec]:
    """What ranks 1..len(roles) are told: the same config, folder, dtype and addresses; each its own rank, role and
    device."""
    local = config.parallel_config.distributed_executor_backend == "mp"
    return [
        WorkerSpec(
            config=config,
            model_folder=str(folder),
            # Ray gives each actor one GPU, visible as its cuda:0; local workers take GPU `rank`.
            device=(f"cuda:{rank}" if local else "cuda:0") if placement.device.type == "cuda" else "cpu",
            dtype=dtype_name(placement.dtype),
            rank=rank,
            world_size=len(roles) + 1,
            driver_address=endpoint.address,
            store_host=endpoint.host,
            store_port=endpoint.port,
            num_threads=threads,
            keys=endpoint.keys,
            store_path=endpoint.store_path,
            role=role,
        )
        for rank, role in enumerate(roles, start=1)
    ]


def _wait_ready(router: zmq.Socket[bytes], workers: list[Handle], keys: PeerKeys) -> list[bytes]:
    """Wait for every worker's Ready; the identities of ranks 1..N-1, in order. ExecutorError as soon as a worker
    ends (or after the startup timeout).

    A frame is validated like every other (two parts, a typed `Ready[int]`), and must carry the launch's token
    and a rank not yet seen: anything else is logged and dropped, so a forged Ready cannot take a rank's place.
    """
    decoder = FrameDecoder(WorkerReady, "worker control")
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    identities: dict[int, bytes] = {}
    while len(identities) < len(workers):
        if router.poll(_POLL_MS):
            parts = router.recv_multipart()
            if len(parts) != 2:
                logger.warning("dropped a worker control frame of %d parts", len(parts))
                continue
            identity, payload = parts
            message = decoder.decode_or_none(payload)
            if message is None:
                continue
            if not token_matches(message.token, keys):
                logger.warning("refused a worker Ready without this launch's token (rank %d)", message.info)
            elif not 1 <= message.info <= len(workers) or message.info in identities:
                logger.warning("refused a worker Ready of rank %d (unexpected or repeated)", message.info)
            else:
                identities[message.info] = identity
            continue
        if (failure := _first_failure(workers)) is not None:
            raise ExecutorError(f"a worker failed while loading: {failure}")
        if time.monotonic() > deadline:
            raise ExecutorError(
                f"workers not ready after {_STARTUP_TIMEOUT_S:.0f} s: {len(workers) - len(identities)} missing"
            )
    return [identities[rank] for rank in range(1, len(workers) + 1)]


def _first_failure(workers: list[Handle]) -> str | None:
    """The first worker that ended, and how, or None while all run."""
    for handle in workers:
        if not handle.is_alive():
            return f"{handle.describe()} {handle.describe_exit()}"
    return None


def _release(workers: list[Handle], launcher: Launcher) -> None:
    """Kill every worker still running and free what they shared (idempotent; the finalizer calls it)."""
    stop_children(workers, 0.0)
    launcher.close()
