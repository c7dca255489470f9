"""What the driver tells its workers, as msgspec msgpack frames over ZeroMQ (never pickle over a socket).

A worker announces itself with the process stack's `Ready` (procs/control.py; its `info` is the worker's rank),
gets `Start`, then runs `Command`s until `Shutdown`; it answers only `Sleep` and `WakeUp` (a `RankSleepState`).
"""

from __future__ import annotations

from typing import Literal

import msgspec
from pagoda.scheduler import SchedulerOutput
from pagoda.server.config import EngineConfig
from pagoda.server.lora.request import AdapterRun, LoRARequest
from pagoda.server.procs.control import Ready, Shutdown
from pagoda.server.procs.security import PeerKeys

# "afd_attention": attention/FFN disaggregation's attention ranks 1..A-1 (a tensor-parallel shard without MLPs).
WorkerRole = Literal["tensor_parallel", "afd_attention", "ffn"]


class WorkerSpec(msgspec.Struct, frozen=True):
    """Everything a worker needs to build its shard; decided once by the driver so that all ranks agree."""

    config: EngineConfig
    model_folder: str  # resolved by the driver (a GGUF file is converted once, before any worker starts)
    device: str  # e.g. "cpu", "cuda:1"
    dtype: str  # "float32", "bfloat16" or "float16"
    rank: int
    world_size: int
    driver_address: str  # the driver's ZeroMQ ROUTER socket
    store_host: str  # the rendezvous: a TCPStore here under Ray; gloo binds this address too
    store_port: int
    num_threads: int | None  # torch threads of this rank on the CPU; None leaves torch's default
    keys: PeerKeys  # the driver socket's CURVE keys and the token `Ready` carries (procs/security.py)
    store_path: str | None = None  # local workers: a FileStore in the launcher's private folder, no TCP port
    # "ffn": attention/FFN disaggregation's FFN rank (its shard of every layer's MLP, no KV cache); else a shard.
    role: WorkerRole = "tensor_parallel"


# A worker's `Ready`: its `info` is its rank.
WorkerReady = Ready[int]


class Start(msgspec.Struct, frozen=True):
    """The KV-cache size every rank allocates (the driver's), then the process group forms."""

    num_blocks: int
    num_host_blocks: int


class Execute(msgspec.Struct, frozen=True, tag=True):
    """Run one scheduled step on this rank's shard (its block moves too)."""

    output: SchedulerOutput
    loras: tuple[LoRARequest, ...] = ()  # the adapters the step uses (a rank reads one it does not hold)


class ComputeLogits(msgspec.Struct, frozen=True, tag=True):
    """Run the LM head over hidden states the driver broadcasts next ([num_rows, hidden_size])."""

    num_rows: int
    hidden_size: int


class Sleep(msgspec.Struct, frozen=True, tag=True):
    """Sleep mode: free this rank's KV pool and release its shard's weights (read back from the checkpoint at
    wake); the worker answers with its `RankSleepState`."""

    level: int


class WakeUp(msgspec.Struct, frozen=True, tag=True):
    """Sleep mode: wake what `tags` name ("weights", "kv_cache"); the worker answers with its `RankSleepState`."""

    tags: tuple[str, ...]


class RankSleepState(msgspec.Struct, frozen=True):
    """A worker's answer to Sleep / WakeUp: what it holds now."""

    rank: int
    weight_bytes: int  # resident weight bytes of its shard (0 while its weights sleep)
    kv_tensors: int  # its KV pool's device tensors (0 while the pool sleeps)


Command = Execute | ComputeLogits | Sleep | WakeUp | Shutdown


class FFNForward(msgspec.Struct, frozen=True, tag=True):
    """Attention/FFN disaggregation: one forward pass is coming, as micro-batches of these many tokens; for every
    layer, in order, each FFN rank receives each micro-batch's MLP input from attention rank 0, and the first FFN
    rank sends its MLP output (all-reduced over the FFN ranks when there are several) to every attention rank."""

    num_tokens: tuple[int, ...]
    # With LoRA: the step's adapters (a rank reads one it does not hold) and each micro-batch's chunks' adapters
    # in row order, from which each FFN rank sets every row's slot for its MLP projections' hooks.
    loras: tuple[LoRARequest, ...] = ()
    adapters: tuple[tuple[AdapterRun, ...], ...] = ()


class FFNReport(msgspec.Struct, frozen=True, tag=True):
    """Attention/FFN disaggregation: every FFN rank answers with its `FFNCounts`."""


class FFNCounts(msgspec.Struct, frozen=True):
    """What an FFN rank has done so far."""

    rank: int
    forwards: int  # FFNForward commands run
    micro_batches: int  # micro-batches over all forwards (2 per forward when the driver ping-pongs)
    mlp_seconds: float  # wall time in the MLPs
    wait_seconds: float  # wall time waiting for the attention rank's activations and its receives


FFNCommand = FFNForward | FFNReport | Sleep | WakeUp | Shutdown  # Sleep / WakeUp: only with sleep mode on
