"""`EngineCore`: the `LLMEngine` step loop in a process of its own, behind two ZeroMQ sockets.

The front end binds a PUSH socket (inputs) and a PULL socket (outputs) per core; the core connects to both, so
the same code serves a local process (ipc://) and a Ray actor on another node (tcp://). Between two steps the
core applies every queued input; after each step it sends the changed requests as deltas with its stats.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import msgspec
import zmq
from pagoda.server.client_stream import EngineSleepingError
from pagoda.server.config import EngineConfig
from pagoda.server.core.block_maps import CoreBlockMaps
from pagoda.server.core.deltas import DeltaEncoder
from pagoda.server.core.lora_core import CoreLoRA
from pagoda.server.core.messages import (
    AbortRequests,
    Accepted,
    AddRequest,
    BlockMap,
    CoreOutput,
    EngineInfo,
    Outputs,
    Rejected,
    SnapshotRequest,
    input_decoder,
)
from pagoda.server.core.sleep_core import CoreSleep
from pagoda.server.engine import LLMEngine
from pagoda.server.kv_events.keys import KVEventsKeys
from pagoda.server.kv_tiers.peer import KVTransferSpec, local_address_towards
from pagoda.server.loader import resolve_tokenizer_folder
from pagoda.server.procs import ChildSpec, Failed, Program, Ready, Shutdown
from pagoda.server.procs.security import LaunchKeys, PeerKeys, connect_securely

logger = logging.getLogger(__name__)

# How long an idle core waits for input before it looks again (at a SIGTERM's drain, say).
_IDLE_POLL_MS = 200
# ... and while a dashboard view is being encoded on its worker thread (it is sent from the loop).
_VIEW_POLL_MS = 5


@dataclass(frozen=True, slots=True)
class CoreSpec:
    """Where a core connects and what it serves: the spec a launcher hands the `CORE_PROGRAM`."""

    config_frame: bytes  # the EngineConfig, msgpack-encoded (no pickle, even on the spawn pipe)
    input_address: str
    output_address: str
    keys: PeerKeys  # the sockets' CURVE keys and the token its `Ready` carries (procs/security.py)
    kv_events_keys: KVEventsKeys | None = None  # its KV events publisher's CURVE keys (kv_events/keys.py)
    kv_transfer_keys: LaunchKeys | None = None  # the launch's KV block transfer keys (`--kv-transfer tcp`)


def engine_info(engine: LLMEngine) -> EngineInfo:
    """The engine's description for the front end."""
    tokenizer = engine.config.model_config.tokenizer
    folder = engine.model_path if tokenizer is None else resolve_tokenizer_folder(tokenizer)
    return EngineInfo(
        model_name=engine.model_name,
        tokenizer_folder=str(Path(folder).resolve()),
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        num_kv_blocks=engine.num_kv_blocks,
        block_size=engine.block_size,
        supported_tasks=engine.supported_tasks,
        kv_block_bytes=engine.kv_block_bytes,
        kv_endpoint=engine.kv_endpoint,
    )


class EngineCore:
    """Serve one engine over connected sockets until `Shutdown`, or SIGTERM once it has drained."""

    def __init__(
        self, engine: LLMEngine, inputs: zmq.Socket[bytes], outputs: zmq.Socket[bytes], token: str
    ) -> None:
        self.engine = engine
        self._token = token
        self._inputs = inputs
        self._outputs = outputs
        self._decoder = input_decoder()
        self._encoder = msgspec.msgpack.Encoder()
        self._deltas = DeltaEncoder()
        self._views = CoreBlockMaps()
        self._stop = False
        self.draining = False  # set by SIGTERM: refuse new requests, exit once the rest finished
        self._lora = CoreLoRA(engine, self._send)  # runtime LoRA load / unload (core/lora_core.py)
        self._sleep = CoreSleep(engine, self._send)  # sleep mode (core/sleep_core.py)

    def run(self) -> None:
        """Announce readiness, then step and serve inputs until told to stop."""
        engine = self.engine
        self._send(
            Ready(info=engine_info(engine), pid=os.getpid(), token=self._token, stats=engine.get_stats())
        )
        try:
            while not self._stop:
                busy = engine.has_unfinished_requests()
                if self.draining and not busy:
                    logger.info("engine core drained; exiting")
                    return
                self._serve_inputs(block=not busy)
                self._lora.poll()
                self._sleep.poll()
                if (view := self._views.take()) is not None:
                    self._send(BlockMap(view))
                if self._stop or not engine.has_unfinished_requests():
                    continue
                outputs = engine.step()
                if outputs:
                    deltas = [self._deltas.encode(output) for output in outputs]
                    self._send(Outputs(outputs=deltas, stats=engine.get_stats()))
        finally:
            self._views.close()

    def _serve_inputs(self, *, block: bool) -> None:
        """Apply every queued input; wait up to _IDLE_POLL_MS for the first one if `block`."""
        if block and not self._inputs.poll(_VIEW_POLL_MS if self._views.pending else _IDLE_POLL_MS):
            return
        accepted: list[str] = []
        while not self._stop:
            try:
                frame = self._inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            message = self._decoder.decode_or_none(frame.buffer)
            if isinstance(message, AddRequest):
                if self._add(message):
                    accepted.append(message.request_id)
            elif isinstance(message, AbortRequests):
                for request_id in message.request_ids:
                    self.engine.abort_request(request_id)
                    self._deltas.forget(request_id)
            elif isinstance(message, SnapshotRequest):
                self._views.request(self.engine)  # between two steps: the copies are consistent
            elif isinstance(message, Shutdown):
                self._stop = True
            elif not self._sleep.handle(message):
                self._lora.handle(message)
        if accepted:
            self._send(Accepted(request_ids=accepted))

    def _add(self, message: AddRequest) -> bool:
        """Queue a request; a refusal is sent back as `Rejected` (with the field at fault), never raised."""
        if self.draining:
            self._send(Rejected(message.request_id, "the engine core is shutting down", None))
            return False
        try:
            multi_modal = None if message.multi_modal is None else message.multi_modal.inputs()
            self.engine.add_request(
                message.request_id,
                message.prompt_token_ids,
                message.params,
                prompt=message.prompt,
                multi_modal=multi_modal,
                resume=message.resume,
            )
        except ValueError as exc:  # RequestRejectedError and the grammar's errors carry `param`
            self._send(Rejected(message.request_id, str(exc), getattr(exc, "param", None)))
            return False
        except (
            EngineSleepingError
        ) as exc:  # the front end routes nothing to a sleeping core; refused, not fatal
            self._send(Rejected(message.request_id, str(exc), None))
            return False
        return True

    def close(self) -> None:
        """Stop the core's helper threads."""
        self._lora.close()

    def _send(self, message: CoreOutput) -> None:
        self._outputs.send(self._encoder.encode(message), copy=False)


def serve_core(spec: CoreSpec, *, handle_signals: bool) -> None:
    """Connect, load the engine, serve until told to stop; a startup or step failure is sent as `Failed`."""
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    outputs = context.socket(zmq.PUSH)
    for socket in (inputs, outputs):
        connect_securely(socket, spec.keys)
    inputs.connect(spec.input_address)
    outputs.connect(spec.output_address)
    try:
        config = msgspec.msgpack.decode(spec.config_frame, type=EngineConfig)
        core = EngineCore(
            LLMEngine.from_config(
                config,
                kv_events_keys=spec.kv_events_keys,
                kv_transfer=None
                if spec.kv_transfer_keys is None
                else KVTransferSpec(spec.kv_transfer_keys, local_address_towards(spec.input_address)),
            ),
            inputs,
            outputs,
            spec.keys.token,
        )
        if handle_signals:

            def drain(sig: int, frame: FrameType | None) -> None:
                core.draining = True

            signal.signal(signal.SIGTERM, drain)
        try:
            core.run()
        finally:
            core.close()
    except BaseException as exc:
        logger.exception("the engine core failed")
        outputs.send(msgspec.msgpack.encode(Failed(f"{type(exc).__name__}: {exc}", kind=type(exc).__name__)))
        raise
    finally:
        # Give the last frames (Failed, the final outputs) a moment to leave, then drop what is left.
        outputs.close(linger=1000)
        inputs.close(linger=0)
        context.term()


def _run_core(child: ChildSpec[CoreSpec]) -> None:
    """The core program's body: in a process of its own SIGTERM drains; in a Ray actor Ray owns the signals."""
    serve_core(child.spec, handle_signals=child.own_process)


# `python -m pagoda.server.core` runs it as a local process (core/__main__.py); RayLauncher as an actor.
CORE_PROGRAM = Program("core", "pagoda.server.core", CoreSpec, _run_core)
