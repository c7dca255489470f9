"""`CoreClient`: the multiprocess engine-core client, N data-parallel cores behind one router.

It satisfies `EngineClient`, so `AsyncLLM` drives it on its engine thread exactly as it drives an in-process
`LLMEngine`: `add_request` routes and sends a frame, `step` waits briefly for frames from every core and turns
them into the request events of client_stream.py (`Accepted` and `Rejected` frames become `RequestAccepted` and
`RequestFailed`). A core that dies fails its in-flight requests at once (`ReplicaDeadError`), is forgotten by the
router, and is restarted with a backoff while the others keep serving.

Sends never block that one thread: each core's input takes at most `send_hwm` frames (ZeroMQ's high-water mark),
the rest wait in the replica's backlog, and no new request is routed to a full core while another has room. A
core that stays full for more than `stall_timeout` seconds (stuck in a step, or stopped) is treated as sick,
exactly as a dead one: its requests fail with a 503 to retry and it is killed and restarted.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import msgspec
import zmq
from pagoda.scheduler import RequestRejectedError
from pagoda.server.client_stream import (
    EngineDeadError,
    ReplicaDeadError,
    RequestAccepted,
    RequestEvent,
    RequestFailed,
)
from pagoda.server.config import EngineConfig, KVTransferName
from pagoda.server.core.disagg import Disaggregation, HandOff, Role
from pagoda.server.core.kv_subscriber import KVEventSubscriptions
from pagoda.server.core.lora_calls import LoRACalls
from pagoda.server.core.lora_frames import LoRADone, UnloadLoRA
from pagoda.server.core.messages import (
    AbortRequests,
    Accepted,
    AddRequest,
    BlockMap,
    EngineInfo,
    Outputs,
    Rejected,
    SnapshotRequest,
    output_decoder,
)
from pagoda.server.core.replica import ACCEPT_TIMEOUT_S, Replica
from pagoda.server.core.sleep_calls import SleepCalls
from pagoda.server.core.sleep_frames import SleepDone
from pagoda.server.engine_client import ReplicaStatus
from pagoda.server.kv_events.config import for_replica
from pagoda.server.kv_events.keys import publishing_keys, remove_certificate, write_certificate
from pagoda.server.kv_tiers.connector import KVTierStats
from pagoda.server.lora.request import LoRARequest
from pagoda.server.multimodal import MultiModalInputs
from pagoda.server.multimodal.inputs import block_keys
from pagoda.server.multimodal.wire import WireMultiModal
from pagoda.server.outputs import EngineStats, RequestOutput
from pagoda.server.pooling import SupportedTask
from pagoda.server.procs import Failed, Launcher, Ready, Shutdown, stop_children
from pagoda.server.procs.security import Authenticator, LaunchKeys, token_matches
from pagoda.server.routing import CacheAwareRouter, ReplicaLoad, Router
from pagoda.server.sampling_params import SamplingParams
from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# How long one `step` waits for frames: an add or abort queued meanwhile waits at most this long (plus a step).
_POLL_MS = 5
# How often the liveness of the cores is checked.
_LIVENESS_S = 0.1
DEFAULT_READY_TIMEOUT_S = 600.0
DEFAULT_SEND_HWM = 1000
DEFAULT_STALL_TIMEOUT_S = 30.0
# A core that has not answered a SnapshotRequest after this long is asked again (the answer was lost).
_MAP_RETRY_S = 2.0


class CoreStartupError(RuntimeError):
    """An engine core did not become ready (it failed, exited, or timed out)."""


class CoreConfigError(CoreStartupError):
    """An engine core refused a flag at start-up (e.g. a --max-model-len its KV pool cannot hold): the CLI exits 2."""


# Exceptions a core raises at start-up that mean a bad flag, by class name (engine/setup.py's MaxModelLenError;
# named, not imported: the front end does not load the engine's modules).
CONFIG_ERRORS = frozenset({"MaxModelLenError"})


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's: counts and counters add up, KV usage is over all blocks, a shared KV
    tier's occupancy is counted once."""
    blocks = sum(s.num_kv_blocks for s in stats)
    used = sum(s.kv_cache_usage * s.num_kv_blocks for s in stats)
    first = stats[0]
    return EngineStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        num_swapped=sum(s.num_swapped for s in stats),
        kv_cache_usage=used / blocks if blocks else 0.0,
        num_kv_blocks=blocks,
        block_size=first.block_size,
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        prompt_tokens=sum(s.prompt_tokens for s in stats),
        generation_tokens=sum(s.generation_tokens for s in stats),
        num_host_blocks=sum(s.num_host_blocks for s in stats),
        enable_prefix_caching=first.enable_prefix_caching,
        kv_cache_usage_per_group=_group_usage(stats, blocks),
        spec_decode_num_drafts=sum(s.spec_decode_num_drafts for s in stats),
        spec_decode_num_draft_tokens=sum(s.spec_decode_num_draft_tokens for s in stats),
        spec_decode_num_accepted_tokens=sum(s.spec_decode_num_accepted_tokens for s in stats),
        spec_decode_num_accepted_tokens_per_pos=tuple(
            map(
                sum,
                itertools.zip_longest(
                    *(s.spec_decode_num_accepted_tokens_per_pos for s in stats), fillvalue=0
                ),
            )
        ),
        kv_tiers=sum_tier_stats(stats),
        token_budget=sum(s.token_budget for s in stats),
        chunk_size=max(s.chunk_size for s in stats),
        max_num_seqs=sum(s.max_num_seqs for s in stats),
        slo_attainment=_sum_attainment(stats),
        slo_sacrificed=(sum(s.slo_sacrificed[0] for s in stats), sum(s.slo_sacrificed[1] for s in stats)),
    )


def sum_tier_stats(stats: Sequence[EngineStats]) -> tuple[KVTierStats, ...]:
    """The replicas' KV tiers by name, in first-seen order: hits and bytes add up (each replica counts its own),
    occupancy and capacity are the largest one's (the replicas on a host share one tier: never summed)."""
    merged: dict[str, KVTierStats] = {}
    for replica in stats:
        for tier in replica.kv_tiers:
            seen = merged.get(tier.tier)
            merged[tier.tier] = (
                tier
                if seen is None
                else KVTierStats(
                    tier.tier,
                    seen.hits + tier.hits,
                    seen.bytes_in + tier.bytes_in,
                    seen.bytes_out + tier.bytes_out,
                    max(seen.used_bytes, tier.used_bytes),
                    max(seen.capacity_bytes, tier.capacity_bytes),
                )
            )
    return tuple(merged.values())


def _sum_attainment(stats: Sequence[EngineStats]) -> tuple[tuple[int, int, int, int, int], ...]:
    """The replicas' SLO counts added up per priority class."""
    total: dict[int, list[int]] = {}
    for s in stats:
        for priority, *counts in s.slo_attainment:
            row = total.setdefault(priority, [0, 0, 0, 0])
            for i, count in enumerate(counts):
                row[i] += count
    return tuple((p, *c) for p, c in sorted(total.items()))  # type: ignore[misc]


def _group_usage(stats: Sequence[EngineStats], blocks: int) -> tuple[float, ...]:
    """Each KV cache group's usage over every replica's blocks (replicas of one model share their groups)."""
    num_groups = len(stats[0].kv_cache_usage_per_group)
    if not blocks or any(len(s.kv_cache_usage_per_group) != num_groups for s in stats):
        return ()
    return tuple(
        sum(s.kv_cache_usage_per_group[g] * s.num_kv_blocks for s in stats) / blocks
        for g in range(num_groups)
    )


class CoreClient:
    """Engine cores in other processes (or Ray actors), one per data-parallel replica, behind `router`."""

    defers_acceptance = True

    def __init__(
        self,
        config: EngineConfig,
        launcher: Launcher,
        router: Router,
        num_replicas: int,
        *,
        ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
        send_hwm: int = DEFAULT_SEND_HWM,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
        routing_kv_events: bool = False,
        roles: tuple[Role, ...] | None = None,
        kv_transfer: KVTransferName = "shm",
    ) -> None:
        """Start every core and wait for all of them to be ready (CoreStartupError with the reason if not).

        With `roles` (one per core) the cores are disaggregated: prefill cores take new requests, decode cores
        continue them (core/disagg.py), reading the prompt's blocks from the host tier they share ("shm") or pulling
        them from the prefill core over TCP ("tcp": every core serves its blocks, kv_tiers/peer.py).

        With `routing_kv_events` the router (a CacheAwareRouter built with use_kv_events) is fed every core's KV
        cache events, subscribed on each replica's `--kv-events-config` endpoint."""
        # One config per replica: each core's KV-events endpoint is its own (ports offset by its index), and its
        # events name its data-parallel rank.
        self._config_frames = [
            msgspec.msgpack.encode(
                replace(
                    config,
                    cache_config=replace(
                        config.cache_config,
                        kv_events_config=for_replica(config.cache_config.kv_events_config, i),
                    ),
                    parallel_config=replace(config.parallel_config, data_parallel_rank=i),
                )
            )
            for i in range(num_replicas)
        ]
        self._launcher = launcher
        self.router = router
        self._ready_timeout = ready_timeout
        self._send_hwm = send_hwm
        self._stall_timeout = stall_timeout
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._authenticator = Authenticator(self._context)  # admits each start's core only (CURVE + ZAP)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = output_decoder()
        self._owner: dict[str, Replica] = {}  # request id -> the replica serving it
        self._events: list[RequestEvent] = []
        self._next_liveness = 0.0
        # One KV events key pair for every core and restart: consumers (and the router) keep one public key.
        events_config = config.cache_config.kv_events_config
        self.kv_events_keys = publishing_keys(events_config)
        keys = self.kv_events_keys
        self.kv_events_certificate = None if keys is None else write_certificate(keys)
        # One KV transfer key pair for every core and restart (the cores' block servers and their fetchers).
        transfer_keys = LaunchKeys.new() if kv_transfer == "tcp" else None
        self.replicas = [
            Replica(i, kv_events_keys=self.kv_events_keys, kv_transfer_keys=transfer_keys)
            for i in range(num_replicas)
        ]
        self.kv_events: KVEventSubscriptions | None = None
        if routing_kv_events:
            if not isinstance(router, CacheAwareRouter):
                raise ValueError("routing_kv_events needs the cache_aware routing policy")
            if self.kv_events_keys is None:
                raise ValueError("routing_kv_events needs kv_events_config with the zmq publisher")
            self.kv_events = KVEventSubscriptions(
                self._context, events_config, num_replicas, router.apply_events, self.kv_events_keys.public
            )
        self._split = None if roles is None else Disaggregation(roles, config.model_config.seed)
        self._silent_accepts: set[str] = set()  # decode legs: their request was accepted by its prefill core
        self._loras = LoRACalls()  # runtime LoRA loads / unloads, sent to every core (core/lora_calls.py)
        self._sleep = SleepCalls()  # sleep mode's sleeps and wakes, sent to every core (core/sleep_calls.py)
        self.enable_sleep_mode = config.model_config.enable_sleep_mode
        try:
            for replica in self.replicas:
                replica.start(
                    self._context,
                    self._authenticator,
                    launcher,
                    self._config_frames[replica.index],
                    ready_timeout,
                    send_hwm,
                )
            self._wait_ready()
        except BaseException:
            self.close(timeout=5.0)
            raise
        info = self.replicas[0].info
        assert info is not None
        self._info: EngineInfo = info
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(info.tokenizer_folder)
        self._last_stats = sum_stats([r.stats for r in self.replicas if r.stats is not None])

    def _wait_ready(self) -> None:
        """Serve frames until every core sent Ready; raise CoreStartupError if one fails or times out."""
        while not all(r.ready for r in self.replicas):
            self._poll(100)
            now = time.monotonic()
            for replica in self.replicas:
                if replica.ready:
                    continue
                assert replica.handle is not None
                if replica.restart_at is not None or not replica.handle.is_alive():
                    reason = replica.last_error or f"{replica.handle.describe_exit()}; its log above says why"
                    failure = (
                        CoreConfigError if replica.last_error_kind in CONFIG_ERRORS else CoreStartupError
                    )
                    raise failure(f"engine core {replica.index} failed to start: {reason}")
                if now > replica.ready_deadline:
                    raise CoreStartupError(
                        f"engine core {replica.index} was not ready after {self._ready_timeout:.0f} s"
                    )

    # --- EngineClient properties --------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        """The model's path or default name."""
        return self._info.model_name

    @property
    def max_model_len(self) -> int:
        """The longest sequence one request may reach."""
        return self._info.max_model_len

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model accepts."""
        return self._info.vocab_size

    @property
    def num_kv_blocks(self) -> int:
        """KV-cache blocks of one replica."""
        return self._info.num_kv_blocks

    @property
    def supported_tasks(self) -> tuple[SupportedTask, ...]:
        """What the replicas serve (each loads the same model with the same runner)."""
        return self._info.supported_tasks

    @property
    def block_size(self) -> int:
        """Tokens per KV-cache block."""
        return self._info.block_size

    # --- requests -----------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> None:
        """Route the request and send it; its acceptance comes back out of `step`."""
        if request_id in self._owner:
            raise RequestRejectedError(f"request id {request_id!r} is already in use", "request_id")
        self._check_replicas(time.monotonic())  # cheap (waitpid): route nothing to a core known to be dead
        # A full core is skipped while another has room: its frames would only wait in the backlog.
        split = self._split
        entry = [r for r in self.replicas if split is None or split.serves(r.index, "prefill")]
        roomy = any(r.ready and r.full_since is None for r in entry)
        loads = [
            ReplicaLoad(
                alive=r in entry and r.ready and (r.full_since is None or not roomy),
                num_running=r.stats.num_running if r.stats else 0,
                num_waiting=r.stats.num_waiting if r.stats else 0,
                num_tokens=r.num_tokens,
                kv_cache_usage=r.stats.kv_cache_usage if r.stats else 0.0,
            )
            for r in self.replicas
        ]
        if not any(load.alive for load in loads):
            raise EngineDeadError("no engine replica is alive (restarting)")
        ids = list(prompt_token_ids)
        if self.kv_events is not None:  # the router decides on every batch the cores published so far
            self.kv_events.drain_all()
        keys = ids if multi_modal is None else block_keys(ids, multi_modal)  # an image routes by content
        replica = self.replicas[self.router.route(keys, loads, salt=params.cache_salt)]
        wire = None if multi_modal is None else WireMultiModal.of(multi_modal)
        if split is not None:  # a request that moves on runs one token here
            params = split.first_leg(request_id, prompt, ids, params, wire)
        self._send_request(replica, AddRequest(request_id, ids, params, prompt, wire))

    def _send_request(self, replica: Replica, frame: AddRequest) -> None:
        """Send a request to `replica`, which owns it from now on."""
        params, ids = frame.params, frame.prompt_token_ids
        replica.requests[frame.request_id] = len(ids) + params.max_tokens * params.n
        replica.decoder.add(frame.request_id, frame.prompt, ids)
        self._owner[frame.request_id] = replica
        replica.pending[frame.request_id] = time.monotonic() + ACCEPT_TIMEOUT_S
        replica.send(self._encoder, frame)

    def _hand_off(self, prefill: Replica, request_id: str, hand: HandOff) -> bool:
        """Send a request's decode leg to the least loaded live decode core (one with room first); False, the
        request failed (to be retried), when none is alive."""
        assert self._split is not None
        prefill.requests.pop(request_id, None)
        decoders = [r for r in self.replicas if r.ready and self._split.serves(r.index, "decode")]
        if not decoders:
            self._fail(request_id, ReplicaDeadError("no decode engine core is alive (restarting)"))
            return False
        replica = min(decoders, key=lambda r: (r.full_since is not None, r.num_tokens))
        self._silent_accepts.add(request_id)
        frame = AddRequest(
            request_id, hand.prompt_token_ids, hand.params, hand.prompt, hand.multi_modal, hand.resume
        )
        self._send_request(replica, frame)
        return True

    def _disaggregated(self, replica: Replica, output: RequestOutput) -> RequestOutput | None:
        """A core's output as the client sees it: a finished prefill leg hands off (and streams on unfinished),
        a decode leg carries its prefill leg's timings; None when the hand-off failed the request."""
        split = self._split
        assert split is not None
        request_id = output.request_id
        if split.is_handed_off(request_id):
            return split.decode_output(output, self.block_size, self._info.kv_block_bytes)
        if not output.finished:
            return output
        hand = split.after_prefill(
            output, self.max_model_len, None if replica.info is None else replica.info.kv_endpoint
        )
        if hand is None:
            return output
        streamed = split.streamed_first(output)
        return streamed if self._hand_off(replica, request_id, hand) else None

    def abort_request(self, request_id: str) -> None:
        """Abort the request in its core; its final snapshot comes out of a later `step`."""
        replica = self._owner.get(request_id)
        if self._split is not None:
            self._split.abort(request_id)  # a prefill leg that finished meanwhile is not handed off
        if replica is not None and replica.ready:
            replica.send(self._encoder, AbortRequests([request_id]))

    def has_unfinished_requests(self) -> bool:
        """True while a request or a LoRA call is out, or a core is (re)starting: each needs `step` to run."""
        return (
            bool(self._owner)
            or not all(r.ready for r in self.replicas)
            or self._loras.pending
            or self._sleep.pending
        )

    def step(self) -> list[RequestEvent]:
        """Wait up to _POLL_MS for frames; return the snapshots and events they carry."""
        self._poll(_POLL_MS)
        now = time.monotonic()
        for replica in self.replicas:
            if replica.backlog:
                replica.flush(now)
        if now >= self._next_liveness:
            self._next_liveness = now + _LIVENESS_S
            self._check_replicas(now)
        live = [r.stats for r in self.replicas if r.ready and r.stats is not None]
        if live:
            self._last_stats = sum_stats(live)
        events, self._events = self._events, []
        return events

    def get_stats(self) -> EngineStats:
        """The live replicas' stats as one engine's."""
        return self._last_stats

    def check_health(self) -> None:
        """Notice a replica that died while the server was idle (it is then restarted); never raises."""
        self._check_replicas(time.monotonic())

    # --- runtime LoRA updating -------------------------------------------------------------------------------

    def load_lora(self, request: LoRARequest) -> Future[tuple[int, ...]]:
        """Send a load to every ready core (on the engine thread); its future: the replicas that serve it now, or
        the first core's LoRAError. A core that starts later loads it too."""
        ready = [r for r in self.replicas if r.ready]
        frame, future = self._loras.load(request, [r.index for r in ready])
        for replica in ready:
            replica.send(self._encoder, frame)
        return future

    def unload_lora(self, lora_name: str) -> Future[tuple[int, ...]]:
        """Send an unload to every ready core; its future as `load_lora`'s. In-flight requests on it finish on it."""
        ready = [r for r in self.replicas if r.ready]
        frame, future = self._loras.unload(lora_name, [r.index for r in ready])
        for replica in ready:
            replica.send(self._encoder, frame)
        return future

    # --- sleep mode ------------------------------------------------------------------------------------------

    def sleep(self, level: int) -> Future[None]:
        """Send a sleep to every ready core (on the engine thread, with no request in flight); its future
        completes once all of them sleep. The router forgets what each replica cached (the pools are freed)."""
        ready = [r for r in self.replicas if r.ready]
        frame, future = self._sleep.sleep(level, [r.index for r in ready])
        for replica in self.replicas:
            self.router.reset_replica(replica.index)
        for replica in ready:
            replica.send(self._encoder, frame)
        return future

    def wake_up(self, tags: Sequence[str] | None = None) -> Future[None]:
        """Send a wake to every ready core; its future completes once all of them woke what `tags` name."""
        ready = [r for r in self.replicas if r.ready]
        frame, future = self._sleep.wake(None if tags is None else list(tags), [r.index for r in ready])
        for replica in ready:
            replica.send(self._encoder, frame)
        return future

    def _roll_back(self, unloads: list[tuple[int, UnloadLoRA]]) -> None:
        """Unload a load that some core refused from the cores that took it (their answers are not awaited)."""
        for index, frame in unloads:
            if self.replicas[index].ready:
                self.replicas[index].send(self._encoder, frame)

    # --- ReplicaSet -----------------------------------------------------------------------------------------

    def replica_status(self) -> list[ReplicaStatus]:
        """Every replica's state, in index order."""
        roles = None if self._split is None else self._split.roles
        return [
            ReplicaStatus(r.ready, r.stats, r.restarts, None if roles is None else roles[r.index])
            for r in self.replicas
        ]

    def router_counts(self) -> tuple[int, int]:
        """The router's (hits, misses) counters."""
        return self.router.hits, self.router.misses

    def kv_transfer_counts(self) -> tuple[int, int, float] | None:
        """Prefill-to-decode hand-offs: (transfers, KV bytes moved, seconds); None without disaggregation."""
        if self._split is None:
            return None
        counters = self._split.counters
        return counters.transfers, counters.bytes, counters.seconds

    # --- the dashboard --------------------------------------------------------------------------------------

    def block_maps(self) -> tuple[dict[str, Any], ...]:
        """The live replicas' last block maps (frame replica objects, index order), and ask each for its next.

        The cores snapshot between two of their steps and encode on a thread of their own; what arrives here is
        already a frame's replica object, so the dashboard's frame lags its cores by one period at most."""
        # An idle server does not step: read the answers here (events are kept for the next `step`).
        self._poll(0)
        now = time.monotonic()
        for replica in self.replicas:
            if not replica.ready:
                continue
            if replica.map_asked_at is None or now - replica.map_asked_at > _MAP_RETRY_S:
                replica.map_asked_at = now
                replica.send(self._encoder, SnapshotRequest())
        return tuple(r.block_map for r in self.replicas if r.ready and r.block_map is not None)

    # --- frames and faults ----------------------------------------------------------------------------------

    def _poll(self, timeout_ms: int) -> None:
        poller = zmq.Poller()
        sockets = {}
        for replica in self.replicas:
            if replica.outputs is not None:
                poller.register(replica.outputs, zmq.POLLIN)
                sockets[replica.outputs] = replica
        # The KV events of `--routing-kv-events`: socket -> its replica's index.
        events_of = {} if self.kv_events is None else {s: i for i, s in enumerate(self.kv_events.sockets)}
        for socket in events_of:
            poller.register(socket, zmq.POLLIN)
        for socket, _ in poller.poll(timeout_ms):
            if socket in events_of:
                assert self.kv_events is not None
                self.kv_events.drain(events_of[socket])
                continue
            replica = sockets[socket]
            while replica.outputs is not None:
                try:
                    frame = replica.outputs.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(replica, frame.buffer)

    def _handle(self, replica: Replica, frame: memoryview) -> None:
        message = self._decoder.decode_or_none(frame)
        if isinstance(message, Outputs):
            replica.stats = message.stats
            for delta in message.outputs:
                output = replica.decoder.decode(delta)
                if output is None:
                    continue
                if self._split is not None and (output := self._disaggregated(replica, output)) is None:
                    continue
                if output.finished:
                    replica.requests.pop(output.request_id, None)
                    self._owner.pop(output.request_id, None)
                self._events.append(output)
        elif isinstance(message, BlockMap):
            replica.block_map = {**message.replica, "replica": replica.index}
            if self._split is not None:  # the dashboard names each core's role
                replica.block_map["role"] = self._split.roles[replica.index]
            replica.map_asked_at = None
        elif isinstance(message, Accepted):
            # Only requests this core was sent and has not answered yet: a repeated or stray id is ignored.
            answered = [request_id for request_id in message.request_ids if request_id in replica.pending]
            for request_id in answered:
                del replica.pending[request_id]
            silent = self._silent_accepts  # a decode leg's request was accepted once, by its prefill core
            self._events += [RequestAccepted(r) for r in answered if r not in silent]
            silent.difference_update(answered)
        elif isinstance(message, Rejected):
            replica.pending.pop(message.request_id, None)
            replica.requests.pop(message.request_id, None)
            replica.decoder.forget(message.request_id)
            self._fail(message.request_id, RequestRejectedError(message.message, message.param or "prompt"))
        elif isinstance(message, Ready):
            if replica.ready or replica.keys is None or not token_matches(message.token, replica.keys.peer):
                logger.warning("engine core %d: refused a Ready without this start's token", replica.index)
                return
            replica.ready = True
            replica.failures = 0
            for load in self._loras.replay():  # adapters loaded at run time, before any request it is sent
                replica.send(self._encoder, load)
            for call in self._sleep.replay():  # the others sleep: so does a core that (re)started meanwhile
                replica.send(self._encoder, call)
            replica.full_since = None  # a wait before it connected is not a stall; flushing stamps a new one
            replica.flush(time.monotonic())
            replica.info = message.info
            replica.stats = message.stats
            logger.info("engine core %d ready (pid %d)", replica.index, message.pid)
        elif isinstance(message, LoRADone):
            self._roll_back(self._loras.answer(replica.index, message))
        elif isinstance(message, SleepDone):
            self._sleep.answer(replica.index, message)
        elif isinstance(message, Failed):
            logger.error("engine core %d failed: %s", replica.index, message.message)
            replica.last_error, replica.last_error_kind = message.message, message.kind
            self._die(replica, f"failed: {message.message}")

    def _check_replicas(self, now: float) -> None:
        for replica in self.replicas:
            if replica.restart_at is not None:
                if now >= replica.restart_at:
                    logger.info("restarting engine core %d", replica.index)
                    replica.restarts += 1
                    replica.start(
                        self._context,
                        self._authenticator,
                        self._launcher,
                        self._config_frames[replica.index],
                        self._ready_timeout,
                        self._send_hwm,
                    )
                continue
            handle = replica.handle
            assert handle is not None
            if not handle.is_alive():
                self._die(replica, handle.describe_exit())
            elif replica.stalled(now, self._stall_timeout):
                self._die(replica, f"sick: its input stayed full for more than {self._stall_timeout:g} s")
            elif not replica.ready and now > replica.ready_deadline:
                self._die(replica, f"not ready after {self._ready_timeout:.0f} s")
            elif (late := replica.overdue(now)) is not None:
                self._die(replica, f"request {late!r} not accepted within {ACCEPT_TIMEOUT_S:.0f} s")

    def _fail(self, request_id: str, error: Exception) -> None:
        """End a request without a finished output: `RequestFailed` out of the next `step`."""
        self._owner.pop(request_id, None)
        self._silent_accepts.discard(request_id)
        if self._split is not None:
            self._split.forget(request_id)
        self._events.append(RequestFailed(request_id, error))

    def _die(self, replica: Replica, reason: str) -> None:
        """The replica died: fail its requests now, make the router forget it, schedule its restart."""
        if replica.restart_at is not None:
            return
        lost = replica.mark_dead(time.monotonic())
        self.router.reset_replica(replica.index)
        self._roll_back(self._loras.replica_lost(replica.index))
        self._sleep.replica_lost(replica.index)
        logger.error(
            "engine core %d died (%s): %d in-flight request(s) fail; restart in %.0f s",
            replica.index,
            reason,
            len(lost),
            (replica.restart_at or 0.0) - time.monotonic(),
        )
        error = ReplicaDeadError(f"engine replica {replica.index} died ({reason})")
        for request_id in lost:
            self._fail(request_id, error)

    def close(self, timeout: float = 30.0) -> None:
        """Tell every core to stop, wait up to `timeout` seconds, kill what is left, release the sockets."""
        for replica in self.replicas:
            if replica.inputs is not None and replica.handle is not None and replica.handle.is_alive():
                replica.send(self._encoder, Shutdown())
        stop_children([r.handle for r in self.replicas if r.handle is not None], timeout)
        for replica in self.replicas:
            for socket in (replica.inputs, replica.outputs):
                if socket is not None:
                    socket.close(linger=0)
            replica.inputs = replica.outputs = None
        if self.kv_events is not None:
            self.kv_events.close()
        if self.kv_events_certificate is not None:
            remove_certificate(self.kv_events_certificate)
        self._authenticator.stop()
        self._context.term()
        self._launcher.close()
