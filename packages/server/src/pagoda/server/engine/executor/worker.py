"""A tensor-parallel worker: one rank's shard of the model and of the KV cache, driven by the driver's commands.
Attention/FFN disaggregation runs the same program: an attention worker is such a shard over the attention ranks,
its MLPs exchanged with the FFN ranks; an FFN worker keeps its shard of every MLP and nothing else (`_run_ffn`).

`WORKER_PROGRAM`: run as `python -m pagoda.server.engine.executor.worker` (its spec on stdin) by the mp executor's
`ProcessLauncher`, or inside a Ray actor by `RayLauncher`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec
import torch
import zmq
from pagoda.server.engine.executor.afd_ffn import FFNCounters, run_ffn_forward
from pagoda.server.engine.executor.afd_model import (
    ATTENTION_GROUP_PREFIX,
    FFN_GROUP_PREFIX,
    AFDForward,
    AFDRanks,
    attention_side,
    ffn_side,
    keep_mlps,
    split_model,
)
from pagoda.server.engine.executor.comm import ProcessGroupCollectives, make_file_store, make_store
from pagoda.server.engine.executor.messages import (
    Command,
    ComputeLogits,
    Execute,
    FFNCommand,
    FFNCounts,
    FFNForward,
    FFNReport,
    RankSleepState,
    Sleep,
    Start,
    WakeUp,
    WorkerReady,
    WorkerSpec,
)
from pagoda.server.engine.kv_cache import KVCache
from pagoda.server.engine.model_runner import ModelRunner
from pagoda.server.engine.setup import (
    Placement,
    build_shard,
    kv_cache_shape,
    pack_rows,
    parse_dtype,
    reload_model,
)
from pagoda.server.engine.sleep import EngineSleep, ModelWeights, SleepingRunner, check_level, check_tags
from pagoda.server.lora.build import build_manager
from pagoda.server.lora.manager import LoRAManager
from pagoda.server.models.parallel import ParallelGroup, SingleRank
from pagoda.server.models.quantized import resident_weight_bytes
from pagoda.server.procs import ChildSpec, Program, Shutdown
from pagoda.server.procs.child import run_process
from pagoda.server.procs.security import connect_securely

logger = logging.getLogger("pagoda.worker")
_POLL_MS = 500  # how often an idle worker checks that its driver still exists
_T = TypeVar("_T")


def run_worker(spec: WorkerSpec, parent_pid: int | None) -> None:
    """Load this rank's shard, report ready, join the group, then run commands until Shutdown or the driver's end.

    `parent_pid`: the driver's process (a local worker leaves its loop once it is gone); None under Ray.
    """
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IDENTITY, f"rank{spec.rank}".encode())
    connect_securely(socket, spec.keys)
    socket.connect(spec.driver_address)
    try:
        placement = Placement(torch.device(spec.device), parse_dtype(spec.dtype))
        if placement.device.type == "cuda":
            torch.cuda.set_device(
                placement.device
            )  # NCCL and the kernels launch on this rank's GPU, not GPU 0
        group = ProcessGroupCollectives(spec.rank, spec.world_size)
        afd = spec.config.parallel_config.attention_ffn_disaggregation
        ranks = None if afd is None else AFDRanks.of(afd)
        if spec.role == "ffn":
            assert ranks is not None
            _run_ffn(spec, placement, group, ranks, socket, parent_pid)
            return
        # An AFD attention rank is a shard of the attention ranks' own tensor-parallel group.
        shard = group if ranks is None else ProcessGroupCollectives(spec.rank, ranks.attention)
        model, backend = build_shard(spec.config, Path(spec.model_folder), placement, shard)
        socket.send(
            msgspec.msgpack.encode(WorkerReady(info=spec.rank, pid=os.getpid(), token=spec.keys.token))
        )
        start = _receive(socket, msgspec.msgpack.Decoder(Start), parent_pid)
        if start is None:
            return
        shape = kv_cache_shape(model, spec.config, placement.dtype)
        kv_cache = KVCache(shape, start.num_blocks, start.num_host_blocks, placement.device, backend)
        store = (
            make_store(spec.store_host, spec.store_port, spec.world_size, is_master=False)
            if spec.store_path is None
            else make_file_store(spec.store_path, spec.world_size)
        )
        group.connect(store, placement.device, spec.store_host)
        if shard is not group:
            shard.connect(store, placement.device, spec.store_host, prefix=ATTENTION_GROUP_PREFIX)
        lora = build_manager(spec.config, model, placement.dtype, placement.device)
        runner = ModelRunner(model, kv_cache, backend, placement.device, () if lora is None else (lora,))
        if ranks is not None:  # its layers exchange their MLPs with the FFN ranks; the driver announces them
            attention_side(model, lora)
            forward = AFDForward(model, group, ranks, None, lora)
            runner.forward = forward
            runner.hooks = (*runner.hooks, forward)  # after LoRA's: the step is slotted
        sleeping = (
            _shard_sleep(spec, runner, placement, shard)
            if spec.config.model_config.enable_sleep_mode
            else None
        )
        _serve(runner, lora, sleeping, shard, socket, spec, parent_pid)
    finally:
        socket.close()
        context.term()


def _run_ffn(
    spec: WorkerSpec,
    placement: Placement,
    group: ProcessGroupCollectives,
    ranks: AFDRanks,
    socket: zmq.Socket[bytes],
    parent_pid: int | None,
) -> None:
    """Attention/FFN disaggregation's FFN rank: load its shard of the model (the whole of it with one FFN rank),
    keep every layer's MLP (and LoRA's hooks of their projections), report ready, join the group (and the FFN
    ranks' own group), then run `FFNForward`s until Shutdown or the driver's end (no KV cache here)."""
    # FFN ranks A..A+F-1 are ranks 0..F-1 of their own tensor-parallel group: the MLPs' row-parallel down
    # projection all-reduces over it, and the first FFN rank alone answers the attention ranks.
    ffn_group = ProcessGroupCollectives(spec.rank - ranks.first_ffn, ranks.ffn)
    shard_group = ffn_group if ranks.ffn > 1 else SingleRank()
    # Loaded as a shard, then cut to the MLPs: the rest is freed with `model`.
    model, _ = build_shard(spec.config, Path(spec.model_folder), placement, shard_group)
    lora = build_manager(spec.config, model, placement.dtype, placement.device)
    mlps = ffn_side(model, lora)
    hidden_size = int(model.get_parameter("model.norm.weight").shape[0])
    del model
    sleeping = (
        _ffn_sleep(spec, mlps, placement, shard_group) if spec.config.model_config.enable_sleep_mode else None
    )
    socket.send(msgspec.msgpack.encode(WorkerReady(info=spec.rank, pid=os.getpid(), token=spec.keys.token)))
    if _receive(socket, msgspec.msgpack.Decoder(Start), parent_pid) is None:
        return
    store = (
        make_store(spec.store_host, spec.store_port, spec.world_size, is_master=False)
        if spec.store_path is None
        else make_file_store(spec.store_path, spec.world_size)
    )
    group.connect(store, placement.device, spec.store_host)
    if ranks.ffn > 1:
        ffn_group.connect(store, placement.device, spec.store_host, prefix=FFN_GROUP_PREFIX)
    decoder = msgspec.msgpack.Decoder(FFNCommand)
    counters = FFNCounters()
    while True:
        command = _receive(socket, decoder, parent_pid)
        if command is None or isinstance(command, Shutdown):
            return
        if isinstance(command, FFNForward):
            select = None if lora is None else _adapter_rows(lora, command)
            try:
                run_ffn_forward(
                    mlps,
                    group,
                    ranks,
                    command.num_tokens,
                    hidden_size,
                    placement.dtype,
                    placement.device,
                    counters,
                    select,
                )
            finally:
                if lora is not None:
                    lora.clear()
        elif isinstance(command, Sleep | WakeUp) and sleeping is not None:  # sent only with sleep mode on
            if isinstance(command, Sleep):
                sleeping.sleep(check_level(command.level))
            else:
                sleeping.wake_up(check_tags(command.tags))
            state = RankSleepState(spec.rank, resident_weight_bytes(mlps), kv_tensors=0)  # no KV pool here
            socket.send(msgspec.msgpack.encode(state))
        elif isinstance(command, FFNReport):
            counts = FFNCounts(
                spec.rank,
                counters.forwards,
                counters.micro_batches,
                counters.mlp_seconds,
                counters.wait_seconds,
            )
            socket.send(msgspec.msgpack.encode(counts))


def _adapter_rows(lora: LoRAManager, command: FFNForward) -> Callable[[int], None]:
    """Slot the forward's adapters (reading any this rank does not hold); what points the MLP projections' hooks
    at a micro-batch's rows."""
    lora.ensure(command.loras)
    lora.prepare([run for part in command.adapters for run in part])
    rows = [lora.rows_of(part) for part in command.adapters]
    return lambda tag: lora.use(rows[tag])


def _ffn_sleep(
    spec: WorkerSpec, mlps: torch.nn.ModuleList, placement: Placement, group: ParallelGroup
) -> EngineSleep:
    """Sleep mode's state of an FFN rank: its MLPs (no KV pool), read back at wake as its shard's MLPs (the rest of
    the fresh shard is dropped with it); released at level 1 on CUDA to host memory, as the engine's weights."""
    folder = Path(spec.model_folder)

    def reload_mlps() -> torch.nn.Module:
        _, layers, _ = split_model(reload_model(spec.config, folder, placement, group=group))
        return keep_mlps(layers)

    weights = ModelWeights(mlps, reload_mlps, pack_rows(spec.config))
    return EngineSleep([SleepingRunner(None, weights)], placement.device)


def _shard_sleep(
    spec: WorkerSpec, runner: ModelRunner, placement: Placement, group: ProcessGroupCollectives
) -> EngineSleep:
    """Sleep mode's state of this rank: its KV pool and its shard, read back as a shard at wake."""
    folder = Path(spec.model_folder)

    def reload_shard() -> torch.nn.Module:
        return reload_model(spec.config, folder, placement, group=group)

    weights = ModelWeights(runner.model, reload_shard, pack_rows(spec.config))
    return EngineSleep([SleepingRunner(runner.kv_cache, weights)], placement.device)


def _serve(
    runner: ModelRunner,
    lora: LoRAManager | None,
    sleeping: EngineSleep | None,
    group: ProcessGroupCollectives,
    socket: zmq.Socket[bytes],
    spec: WorkerSpec,
    parent_pid: int | None,
) -> None:
    """Run each command in lockstep with the driver; the forward's collectives keep the ranks together."""
    decoder = msgspec.msgpack.Decoder(Command)
    while True:
        command = _receive(socket, decoder, parent_pid)
        if command is None or isinstance(command, Shutdown):
            return
        if isinstance(command, Execute):
            if lora is not None:  # read (this rank's shard of) the step's adapters it does not hold yet
                lora.ensure(command.loras)
            runner.execute(command.output, {})  # rank 0 gathers the logits; this rank's run is dropped
        elif isinstance(command, ComputeLogits):
            dtype = runner.kv_cache.shape.dtype
            hidden = torch.empty(command.num_rows, command.hidden_size, dtype=dtype, device=runner.device)
            runner.compute_logits(group.broadcast(hidden))
        elif isinstance(command, Sleep | WakeUp) and sleeping is not None:  # sent only with sleep mode on
            if isinstance(command, Sleep):
                sleeping.sleep(check_level(command.level))
            else:
                sleeping.wake_up(check_tags(command.tags))
            state = RankSleepState(
                spec.rank, resident_weight_bytes(runner.model), len(runner.kv_cache.device_caches)
            )
            socket.send(msgspec.msgpack.encode(state))


def _receive(
    socket: zmq.Socket[bytes], decoder: msgspec.msgpack.Decoder[_T], parent_pid: int | None
) -> _T | None:
    """The next message, or None once the driver's process is gone."""
    while not socket.poll(_POLL_MS):
        if parent_pid is not None and os.getppid() != parent_pid:
            logger.error("rank's driver (pid %d) is gone: exiting", parent_pid)
            return None
    return decoder.decode(socket.recv())


def _run_worker(child: ChildSpec[WorkerSpec]) -> None:
    """The worker program's body."""
    run_worker(child.spec, child.parent_pid)


WORKER_PROGRAM = Program("worker", "pagoda.server.engine.executor.worker", WorkerSpec, _run_worker)

if __name__ == "__main__":
    run_process(WORKER_PROGRAM)
