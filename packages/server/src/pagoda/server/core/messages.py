"""The frames between a front end and an engine core: msgspec Structs, msgpack-encoded, never pickle.

Front end -> core: `AddRequest`, `AbortRequests`, `Shutdown`, `SnapshotRequest` (the `CoreInput` union). Core
-> front end: `Ready` once the model is loaded, then `Outputs` after each step and `Accepted` / `Rejected` for
each added request, `BlockMap` answering a `SnapshotRequest`, or `Failed` before it exits on an error (the
`CoreOutput` union). Runtime LoRA updating adds `LoadLoRA` / `UnloadLoRA` and their `LoRADone`
(core/lora_frames.py), sleep mode `SleepEngine` / `WakeEngine` and their `SleepDone` (core/sleep_frames.py).
`Ready`, `Shutdown` and `Failed` are the process stack's control frames (procs/control.py),
shared with the tensor-parallel workers. Every decoder is typed: a frame that is not exactly one of these fails
to decode, and the receiver drops it (`decode_or_none`) instead of acting on it.
"""

from __future__ import annotations

from typing import Any

import msgspec
from pagoda.server.core.lora_frames import LoadLoRA, LoRADone, UnloadLoRA
from pagoda.server.core.sleep_frames import SleepDone, SleepEngine, WakeEngine
from pagoda.server.handoff import Resume
from pagoda.server.multimodal.wire import WireMultiModal
from pagoda.server.outputs import EngineStats, FinishReason, Logprob, RequestMetrics
from pagoda.server.pooling import SupportedTask
from pagoda.server.procs.control import Failed, FrameDecoder, Ready, Shutdown
from pagoda.server.sampling_params import SamplingParams

PositionLogprobs = dict[int, Logprob]


class AddRequest(msgspec.Struct, frozen=True, tag=True):
    """Queue a request in the core (the core stamps its own arrival time: clocks differ across nodes)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    multi_modal: WireMultiModal | None = None  # the prompt's images (a vision-language model)
    resume: Resume | None = None  # its outputs so far, drawn by a prefill core (disaggregated serving)


class AbortRequests(msgspec.Struct, frozen=True, tag=True):
    """Abort requests and free their blocks; unknown ids are ignored."""

    request_ids: list[str]


class SnapshotRequest(msgspec.Struct, frozen=True, tag=True):
    """Send the block map and queues once, between two steps (the dashboard; ignored while one is on its way)."""


# LoRA: core/lora_frames.py; sleep mode: core/sleep_frames.py
CoreInput = (
    AddRequest | AbortRequests | Shutdown | SnapshotRequest | LoadLoRA | UnloadLoRA | SleepEngine | WakeEngine
)


class EngineInfo(msgspec.Struct, frozen=True):
    """What the front end needs to know of a loaded engine (the `EngineClient` properties)."""

    model_name: str
    tokenizer_folder: str  # the front end loads the same tokenizer files (shared storage across nodes)
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    supported_tasks: tuple[SupportedTask, ...] = (
        "generate",
    )  # what the front end may send (generate, embed, score)
    kv_block_bytes: int = 0  # one block position over every layer and KV group (the KV transfer metrics)
    kv_endpoint: str | None = None  # its KV block server (`--kv-transfer tcp`), where decode cores pull from


class SampleDelta(msgspec.Struct, frozen=True):
    """One sample's change since the last frame: keep the first `*_keep` items of each field, append the rest.

    Cumulative snapshots would send O(length^2) bytes per request; a delta sends each token once (a beam's
    rewrite or a stop string's truncation shows as a shorter keep).
    """

    index: int
    token_ids_keep: int
    token_ids: list[int]
    text_keep: int
    text: str
    logprobs_keep: int
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None


class OutputDelta(msgspec.Struct, frozen=True):
    """One request's change after a step (its prompt stays with the front end, which sent it)."""

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int
    prompt_logprobs_keep: int
    prompt_logprobs: list[PositionLogprobs | None] | None
    embedding: list[float] | None = None  # a pooling request's vector, in its finished frame


class Outputs(msgspec.Struct, frozen=True, tag=True):
    """The requests a step changed, and the engine's stats after it."""

    outputs: list[OutputDelta]
    stats: EngineStats


class Accepted(msgspec.Struct, frozen=True, tag=True):
    """The core queued these requests."""

    request_ids: list[str]


class Rejected(msgspec.Struct, frozen=True, tag=True):
    """The core refused a request; `param` names the field at fault (a 400 in the API)."""

    request_id: str
    message: str
    param: str | None


class BlockMap(msgspec.Struct, frozen=True, tag=True):
    """The core's dashboard view, encoded off its step loop: a frame's replica object (dashboard/encoder.py)."""

    replica: dict[str, Any]


# `Ready.info` is the core's `EngineInfo`, `Ready.stats` its stats before the first step.
CoreOutput = Ready[EngineInfo] | Outputs | Accepted | Rejected | Failed | BlockMap | LoRADone | SleepDone


def input_decoder() -> FrameDecoder[CoreInput]:
    """The core's decoder of the front end's frames."""
    return FrameDecoder(CoreInput, "core input")  # type: ignore[arg-type]


def output_decoder() -> FrameDecoder[CoreOutput]:
    """The front end's decoder of a core's frames."""
    return FrameDecoder(CoreOutput, "core output")  # type: ignore[arg-type]
