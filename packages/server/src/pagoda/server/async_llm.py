"""`AsyncLLM`: runs a synchronous engine on one background thread and streams its snapshots to asyncio.

The event loop never runs a model step. Commands (add, abort, stop) go to the engine thread through a
thread-safe queue and are applied between steps, so an abort frees its KV blocks before the next step. Each
request's events (client_stream.py: `RequestAccepted`, outputs, `RequestFailed`) come back through its own
`OutputBox`, which keeps only the latest output (they are cumulative), so a slow reader costs one snapshot; a
reader that leaves a snapshot unread past `stream_stall_timeout` is aborted.

Sleep mode (engine/sleep.py): `sleep` stops admitting requests at once (a 503 with Retry-After, or with
--wake-on-request a wake), lets the engine finish the ones in flight, then puts it to sleep between two steps on the
engine thread; `wake_up` wakes it there too. With --sleep-idle-seconds an idle engine sleeps on its own.

A step that raises is handled by `--on-engine-failure`: "restart" fails the in-flight requests with a 503 to
retry (`EngineRestartedError`) and rebuilds the engine from its config; "exit" and "none" (and an engine given no
`rebuild`) fail them for good (`EngineDeadError`) and leave the engine dead; with "exit", or when a rebuild
fails, the server then stops with a non-zero status (`wait_fatal`), for a supervisor to restart the process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pagoda.scheduler import RequestRejectedError
from pagoda.server.client_stream import (
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    EngineRestartedError,
    EngineSleepingError,
    RequestAccepted,
    RequestEvent,
    RequestFailed,
)
from pagoda.server.config import ServingConfig
from pagoda.server.engine.host import release_openmp_threads
from pagoda.server.engine.sleep import SleepModeError, check_level, check_tags
from pagoda.server.engine_client import EngineClient, ReplicaSet, SupportsSleep
from pagoda.server.metrics import ServerMetrics
from pagoda.server.multimodal import MultiModalInputs
from pagoda.server.output_box import OutputBox
from pagoda.server.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from pagoda.server.sampling_params import SamplingParams

T = TypeVar("T")

logger = logging.getLogger(__name__)

# How often the engine thread checks the engine's health while no request runs (seconds).
_IDLE_HEALTH_CHECK_S = 0.5


@dataclass(frozen=True, slots=True)
class PromptRequest:
    """One engine request of an HTTP request: its id, its prompt's token ids and (if it had one) its text."""

    request_id: str
    prompt_token_ids: Sequence[int]
    prompt: str | None = None
    multi_modal: MultiModalInputs | None = None  # the prompt's images (a vision-language model)


@dataclass(slots=True)
class _Stream:
    """One request's channel. The engine thread owns every field except `box`'s consumer side."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    multi_modal: MultiModalInputs | None
    n: int  # samples it reports
    num_seqs: int  # sequences it holds in the engine: n, or the beam width of a beam search
    arrival: float  # time.monotonic() when the server accepted it
    box: OutputBox
    last: RequestOutput | None = None
    num_tokens: int = 0
    last_token_time: float | None = None


@dataclass(frozen=True, slots=True)
class _Add:
    stream: _Stream
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str
    notify: bool  # send the client a final "abort" snapshot (shutdown) or not (it left)


@dataclass(frozen=True, slots=True)
class _AbortAll:
    pass


@dataclass(frozen=True, slots=True)
class _Stop:
    pass


@dataclass(frozen=True, slots=True)
class _Call:
    """Run `fn(engine)` on the engine thread between two steps (a live view's snapshot, a LoRA load or unload)."""

    fn: Callable[[EngineClient], Any]
    future: concurrent.futures.Future[Any]


@dataclass(frozen=True, slots=True)
class _Sleep:
    """Put the engine to sleep once it has no unfinished request (sleep mode)."""

    level: int
    future: concurrent.futures.Future[None]


@dataclass(frozen=True, slots=True)
class _Wake:
    """Wake what `tags` name (sleep mode); a sleep still waiting for the engine to be idle is called off."""

    tags: tuple[str, ...] | None
    future: concurrent.futures.Future[None]


_Command = _Add | _Abort | _AbortAll | _Stop | _Call | _Sleep | _Wake

# What sleeps and wakes (engine/sleep.py's tags): all of it after a sleep, until a wake names each.
_SLEEP_TAGS = frozenset({"weights", "kv_cache"})


def _aborted_snapshot(stream: _Stream) -> RequestOutput:
    """The final snapshot of an aborted request: what it had so far, every unfinished sample marked abort."""
    last = stream.last
    if last is None:
        empty = tuple(
            CompletionOutput(index=i, text="", token_ids=(), cumulative_logprob=None, logprobs=None)
            for i in range(stream.n)
        )
        last = RequestOutput(
            request_id=stream.request_id,
            prompt=stream.prompt,
            prompt_token_ids=stream.prompt_token_ids,
            outputs=empty,
            finished=False,
            metrics=RequestMetrics(arrival_time=stream.arrival),
        )
    outputs = tuple(o if o.finished else replace(o, finish_reason="abort") for o in last.outputs)
    return replace(last, outputs=outputs, finished=True)


class AsyncLLM:
    """Asynchronous front of an engine: `generate` streams snapshots; admission, draining and death handling."""

    def __init__(
        self,
        engine: EngineClient,
        config: ServingConfig | None = None,
        *,
        rebuild: Callable[[], EngineClient] | None = None,
    ) -> None:
        """Front `engine` with `config`'s limits; the served model name defaults to the engine's model name.

        `rebuild` makes a fresh engine from the same config: with --on-engine-failure restart, a step that
        raised replaces the engine by `rebuild()` (without it, a failed engine stays dead)."""
        config = config or ServingConfig()
        self.engine = engine
        self._rebuild = rebuild
        self.on_engine_failure = config.on_engine_failure
        self.engine_restarts = 0  # times a failed engine was rebuilt
        self._fatal = asyncio.Event()  # set once the engine died for good and the process should end
        # A remote core answers each add later, out of `step` (RequestAccepted / RequestFailed).
        self._deferred_acceptance = bool(getattr(engine, "defers_acceptance", False))
        self.replicas: ReplicaSet | None = engine if isinstance(engine, ReplicaSet) else None
        self.served_model_name = config.served_model_name or engine.model_name
        self.max_waiting_requests = config.max_waiting_requests
        self.stream_stall_timeout = config.stream_stall_timeout
        self.num_stalled_aborts = 0  # requests aborted because their reader left a snapshot unread too long
        self.max_concurrent_requests = (
            config.max_concurrent_requests
        )  # TGI's limit on requests (prompts) in flight
        self._stats: EngineStats = engine.get_stats()
        self.metrics = ServerMetrics(
            self.served_model_name, lambda: self._stats, config.metrics_prefix, self.replicas
        )
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "is it dead?" against "put a command"
        self._dead: BaseException | None = None
        self._draining = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the streams are read on (start())
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._open: dict[str, _Stream] = {}  # event loop only: the streams of unreleased RequestStreams
        # Event-loop side accounting.
        self._num_pending_seqs = 0  # admitted sequences that have no token yet
        self._num_active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # Sleep mode. Event-loop side: what is asleep (or going to sleep), the wake a request started, when the
        # last request came or went; engine-thread side: the sleeps waiting for the engine to be idle.
        self.sleep_mode = isinstance(engine, SupportsSleep) and engine.enable_sleep_mode
        self.wake_on_request = config.wake_on_request
        self.sleep_idle_seconds = config.sleep_idle_seconds
        self.sleep_level: int | None = None  # the level of the last sleep while anything is asleep
        self._asleep: set[str] = set()
        self._waking: asyncio.Future[None] | None = None
        self._last_request = time.monotonic()
        self._idle_sleeper: asyncio.Task[None] | None = None
        self._pending_sleeps: list[_Sleep] = []  # engine thread only

    # --- life cycle (event loop side) ------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the streams."""
        self._loop = asyncio.get_running_loop()
        # The engine was built on this thread, whose OpenMP team would idle beside the engine thread's and make
        # libgomp put every worker to sleep between parallel regions (see release_openmp_threads).
        release_openmp_threads()
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()
        if self.sleep_mode and self.sleep_idle_seconds is not None:
            self._idle_sleeper = asyncio.ensure_future(self._sleep_when_idle(self.sleep_idle_seconds))

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs and has not failed."""
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    async def wait_fatal(self) -> None:
        """Return once the engine died and --on-engine-failure exit wants the process to end (never otherwise)."""
        await self._fatal.wait()

    @property
    def is_draining(self) -> bool:
        """True once shutdown began."""
        return self._draining

    @property
    def stats(self) -> EngineStats:
        """The engine's latest gauges and counters (refreshed by the engine thread after each change)."""
        return self._stats

    @property
    def num_active_requests(self) -> int:
        """Requests being generated now."""
        return self._num_active

    @property
    def num_pending_sequences(self) -> int:
        """Admitted sequences without a token yet: what --max-waiting-requests limits."""
        return self._num_pending_seqs

    @property
    def num_buffered_outputs(self) -> int:
        """Events (acceptances, snapshots, failures) waiting unread in the open streams: at most 3 per stream."""
        return sum(len(stream.box) for stream in self._open.values())

    async def drain(self, timeout: float) -> None:
        """Stop admitting, wait up to `timeout` seconds for in-flight requests, then abort the rest."""
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return
        except TimeoutError:
            logger.warning("shutdown timeout: aborting %d in-flight request(s)", self._num_active)
        self._put(_AbortAll())
        # The aborted requests now get their final snapshot; give their handlers a moment to send it.
        try:
            await asyncio.wait_for(self._idle.wait(), 10.0)
        except TimeoutError:
            logger.warning("%d request(s) did not finish after abort", self._num_active)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (aborting whatever is left) and wait for it."""
        self._draining = True
        if self._idle_sleeper is not None:
            self._idle_sleeper.cancel()
        self._put(_Stop())
        if self._thread is not None:
            self._thread.join(timeout)

    # --- requests (event loop side) --------------------------------------------------------------------

    def check_admission(self, num_seqs: int, n: int, width_param: str = "n") -> None:
        """The one admission rule for an HTTP request of `num_seqs` sequences (prompts x `n`, where `n` is the
        sequences one prompt holds: its samples, or its beam width, named by `width_param`).

        It fits when the pending sequences plus its own stay within --max-waiting-requests, and its prompts plus
        those in flight within --max-concurrent-requests. One that exceeds a limit alone can never fit:
        RequestRejectedError (a 400, naming `width_param` or `prompt`), not a 429 to retry.
        """
        self._check_alive()
        if self._draining:
            raise EngineDrainingError("the server is shutting down")
        num_prompts = num_seqs // n
        concurrent = self.max_concurrent_requests
        if concurrent is not None:
            if num_prompts > concurrent:
                raise RequestRejectedError(
                    f"the request has {num_prompts} prompts, more than --max-concurrent-requests ({concurrent})",
                    "prompt",
                )
            if self._num_active + num_prompts > concurrent:
                raise EngineOverloadedError(f"{self._num_active} requests are in flight (limit {concurrent})")
        limit = self.max_waiting_requests
        if limit is None:
            return
        if num_seqs > limit:
            raise RequestRejectedError(
                f"the request has {num_seqs} sequences (prompts x n), more than --max-waiting-requests "
                f"({limit}) admits at once; it can never be admitted",
                width_param if n > limit else "prompt",
            )
        if self._num_pending_seqs + num_seqs > limit:
            raise EngineOverloadedError(f"{self._num_pending_seqs} sequences are waiting (limit {limit})")

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> RequestStream:
        """Admit one request and wait until the engine accepted it (at most one step); returns its stream."""
        (stream,) = await self.add_requests(
            [PromptRequest(request_id, prompt_token_ids, prompt, multi_modal)], params
        )
        return stream

    async def add_requests(
        self, prompts: Sequence[PromptRequest], params: SamplingParams
    ) -> list[RequestStream]:
        """Admit the prompts of one HTTP request as one admission, then wait until the engine accepted them all.

        Raises EngineDeadError, EngineDrainingError, EngineOverloadedError or RequestRejectedError (see
        `check_admission`), or the engine's ValueError (with `param`) when it rejects a prompt; then none of the
        prompts stays in the engine. Close the streams (or exhaust them) when done.
        """
        while self._asleep:
            if not self.wake_on_request:
                raise EngineSleepingError("the engine is sleeping")
            await self._wake_for_request()
        width = params.num_sequences
        # From here to the submission nothing awaits: no sleep can come between the check and the add.
        self.check_admission(len(prompts) * width, width, "n" if width == params.n else "best_of")
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        streams = [
            _Stream(
                request_id=p.request_id,
                prompt=p.prompt,
                prompt_token_ids=tuple(p.prompt_token_ids),
                multi_modal=p.multi_modal,
                n=params.n,
                num_seqs=width,
                arrival=now,
                box=OutputBox(loop),
            )
            for p in prompts
        ]
        # Counted as pending from here on, synchronously with the check above: no other request interleaves.
        handles = [RequestStream(self, stream) for stream in streams]
        try:
            self._submit(*(_Add(stream, params) for stream in streams))
            answers = [await stream.box.get() for stream in streams]
            failures = [answer for answer in answers if isinstance(answer, RequestFailed)]
            for handle, answer in zip(handles, answers, strict=True):
                if isinstance(answer, RequestFailed):
                    handle.finished = True  # never entered the engine
            if failures:
                raise failures[0].error
        except BaseException:
            for handle in handles:
                handle.close()
            raise
        return handles

    async def call_on_engine_thread(self, fn: Callable[[EngineClient], T]) -> T:
        """Run `fn(engine)` on the engine thread between two steps and return its result (EngineDeadError if
        the engine is dead): cheap reads of engine state that only that thread may touch, LoRA registration."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._submit(_Call(fn, future))
        return await asyncio.wrap_future(future)

    # --- sleep mode (event loop side) -------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        """Whether the engine sleeps, is going to sleep, or is partly awake (GET /is_sleeping)."""
        return bool(self._asleep)

    async def sleep(self, level: int = 1) -> None:
        """Stop admitting requests, let those in flight finish, then put the engine to sleep (engine/sleep.py);
        SleepModeError naming the field when sleep mode is off or the level is bad. Sleeping again does nothing."""
        if not self.sleep_mode:
            raise SleepModeError("sleep mode is off: start the server with --enable-sleep-mode", "model")
        chosen = check_level(level)
        if self._asleep:
            return
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(_Sleep(chosen, future))
        self._asleep = set(_SLEEP_TAGS)
        self.sleep_level = chosen
        # The state follows the engine's answer even when the caller leaves meanwhile (the sleep goes on).
        await asyncio.shield(self._on_engine_answer(future, self._slept))

    def _slept(self, failure: BaseException | None) -> None:
        if failure is not None:  # the engine did not sleep (it died, or the sleep failed): it serves on
            self._asleep.clear()
            self.sleep_level = None
        else:
            logger.info("the engine sleeps (level %d)", self.sleep_level or 0)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake what `tags` name ("weights", "kv_cache"; None: all); requests are admitted again once nothing
        sleeps. SleepModeError naming the field when sleep mode is off or a tag is unknown."""
        if not self.sleep_mode:
            raise SleepModeError("sleep mode is off: start the server with --enable-sleep-mode", "model")
        chosen = check_tags(tags)
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(_Wake(chosen, future))
        await asyncio.shield(self._on_engine_answer(future, lambda failure: self._woke(chosen, failure)))

    def _woke(self, tags: Sequence[str], failure: BaseException | None) -> None:
        if failure is not None:  # a failed reload: what did not wake still sleeps
            return
        self._asleep.difference_update(tags)
        if not self._asleep:
            self.sleep_level = None
            logger.info("the engine is awake")

    def _on_engine_answer(
        self, future: concurrent.futures.Future[None], then: Callable[[BaseException | None], None]
    ) -> asyncio.Future[None]:
        """The engine thread's answer to a sleep or wake as an asyncio future, `then(its failure or None)` run on
        the event loop once it completes, whether or not anyone still awaits it."""
        waiting = asyncio.wrap_future(future)

        def done(answer: asyncio.Future[None]) -> None:
            then(asyncio.CancelledError() if answer.cancelled() else answer.exception())

        waiting.add_done_callback(done)
        return waiting

    def _forget_sleep(self) -> None:
        """The engine was rebuilt awake: nothing sleeps any more."""
        self._asleep.clear()
        self.sleep_level = None

    async def _wake_for_request(self) -> None:
        """--wake-on-request: wake the engine for a request (requests arriving meanwhile wait for the same wake)."""
        if self._waking is None:
            self._waking = asyncio.ensure_future(self.wake_up())
            self._waking.add_done_callback(self._woken)
        await asyncio.shield(self._waking)

    def _woken(self, wake: asyncio.Future[None]) -> None:
        self._waking = None
        if not wake.cancelled() and wake.exception() is not None:
            logger.error("waking the engine for a request failed: %s", wake.exception())

    async def _sleep_when_idle(self, seconds: float) -> None:
        """--sleep-idle-seconds: sleep (level 1) once no request came or went for `seconds`."""
        interval = min(seconds / 4, 1.0)
        while True:
            await asyncio.sleep(interval)
            if self._asleep or self._draining or self._num_active or self._dead is not None:
                continue
            idle = time.monotonic() - self._last_request
            if idle < seconds:
                continue
            logger.info("no request for %.1f s (--sleep-idle-seconds %g): sleeping", idle, seconds)
            try:
                await self.sleep(1)
            except Exception:
                logger.exception("sleeping the idle engine failed")
                self._last_request = time.monotonic()  # try again after another idle period, not at once

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> AsyncGenerator[RequestOutput]:
        """Yield cumulative snapshots of one request until it finishes; aborts it if the consumer leaves."""
        handle = await self.add_request(
            request_id, prompt_token_ids, params, prompt=prompt, multi_modal=multi_modal
        )
        try:
            async for output in handle:
                yield output
        finally:
            handle.close()

    def _admit(self, stream: _Stream) -> None:
        self._last_request = time.monotonic()
        self._num_pending_seqs += stream.num_seqs
        self._num_active += 1
        self._open[stream.request_id] = stream
        self._idle.clear()

    def _first_token(self, num_seqs: int) -> None:
        self._num_pending_seqs -= num_seqs

    def _release(self, request_id: str, *, abort: bool) -> None:
        if abort:
            self._put(_Abort(request_id, notify=False))
        self._open.pop(request_id, None)
        self._num_active -= 1
        self._last_request = time.monotonic()
        if self._num_active == 0:
            self._idle.set()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError("the engine loop has stopped")

    def _submit(self, *commands: _Command) -> None:
        """Queue commands for the engine thread, or raise EngineDeadError: after death nobody reads the queue."""
        with self._lock:
            self._check_alive()
            for command in commands:
                self._commands.put(command)

    def _put(self, command: _Command) -> None:
        # After death nobody reads the queue; dropping the command is then correct.
        with self._lock:
            if self._dead is None:
                self._commands.put(command)

    # --- engine thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._serve_steps()
                return
            except BaseException as exc:
                if not self._recover(exc):
                    return

    def _recover(self, exc: BaseException) -> bool:
        """After a step raised: rebuild the engine (True: serve on) or die (False), per --on-engine-failure."""
        # The exception text stays in this log: clients get a stable 503 (api.serving_base.to_api_error).
        logger.exception("the engine loop failed")
        restart = self.on_engine_failure == "restart" and self._rebuild is not None
        if not restart or not isinstance(exc, Exception):
            self._die(exc)
            if self.on_engine_failure == "exit":
                logger.critical("--on-engine-failure exit: the server stops with a non-zero status")
                self._set_fatal()
            return False
        self._fail_all(EngineRestartedError("the engine failed and is being rebuilt"))
        logger.error("every in-flight request fails (503, retry); rebuilding the engine from its config")
        with contextlib.suppress(Exception):  # a broken engine may fail to close; its replacement matters
            self.engine.close()
        assert self._rebuild is not None
        try:
            self.engine = self._rebuild()
        except Exception as rebuild_exc:
            logger.exception("rebuilding the engine failed; it stays dead and the server stops (non-zero)")
            self._die(rebuild_exc)
            self._set_fatal()  # a server that can never serve again is better restarted by its supervisor
            return False
        self.engine_restarts += 1
        self._stats = self.engine.get_stats()
        if self._loop is not None:  # a rebuilt engine is awake
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._forget_sleep)
        logger.info("the engine was rebuilt (restart %d)", self.engine_restarts)
        return True

    def _set_fatal(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending anyway
                self._loop.call_soon_threadsafe(self._fatal.set)

    def _serve_steps(self) -> None:
        """Apply commands and step the engine until told to stop; a step's exception propagates."""
        while True:
            engine = self.engine
            if self._pending_sleeps and not engine.has_unfinished_requests():
                self._start_sleep(engine)
            if not self._apply_commands(block=not engine.has_unfinished_requests()):
                return
            self._stats = engine.get_stats()
            if not engine.has_unfinished_requests():
                continue
            before = self._stats
            outputs = engine.step()
            now = time.monotonic()
            for event in outputs:
                self._dispatch_event(event, now)
            self._stats = engine.get_stats()
            num_tokens = (self._stats.prompt_tokens + self._stats.generation_tokens) - (
                before.prompt_tokens + before.generation_tokens
            )
            if num_tokens > 0:
                self.metrics.observe_iteration(num_tokens)

    def _apply_commands(self, *, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once told to stop.

        An idle wait checks the engine's health every _IDLE_HEALTH_CHECK_S, so that a tensor-parallel worker (or a
        replica) that dies while nothing runs shows on /health at once, not at the next request.
        """
        try:
            command = (
                self._commands.get(timeout=_IDLE_HEALTH_CHECK_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            if block:
                self.engine.check_health()
            return True
        while True:
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_id, notify=command.notify)
            elif isinstance(command, _Call):
                self._call(command)
            elif isinstance(command, _Sleep):
                self._pending_sleeps.append(command)  # applied once the engine is idle (_serve_steps)
            elif isinstance(command, _Wake):
                self._wake(command)
            elif isinstance(command, _AbortAll):
                for request_id in list(self._streams):
                    self._abort(request_id, notify=True)
            else:
                for request_id in list(self._streams):
                    self._abort(request_id, notify=True)
                return False
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _call(self, command: _Call) -> None:
        if not command.future.set_running_or_notify_cancel():
            return
        try:
            command.future.set_result(command.fn(self.engine))
        except (
            Exception
        ) as exc:  # the caller's error (a bad adapter, a failing view), never the engine loop's
            command.future.set_exception(exc)

    def _start_sleep(self, engine: EngineClient) -> None:
        """Put the idle engine to sleep for every waiting sleep call (an engine-core client answers later)."""
        calls, self._pending_sleeps = self._pending_sleeps, []
        try:
            assert isinstance(engine, SupportsSleep)
            _settle_all(engine.sleep(calls[-1].level), [call.future for call in calls])
        except Exception as exc:  # the caller's failure (a bad state), never the engine loop's
            for call in calls:
                if call.future.set_running_or_notify_cancel():
                    call.future.set_exception(exc)

    def _wake(self, command: _Wake) -> None:
        """Wake the engine; sleeps still waiting for it to be idle are called off (they return as if done)."""
        calls, self._pending_sleeps = self._pending_sleeps, []
        for call in calls:
            if call.future.set_running_or_notify_cancel():
                call.future.set_result(None)
        try:
            engine = self.engine
            assert isinstance(engine, SupportsSleep)
            _settle_all(engine.wake_up(command.tags), [command.future])
        except Exception as exc:  # a failed reload: the engine stays asleep, the caller hears why
            logger.exception("waking the engine failed")
            if command.future.set_running_or_notify_cancel():
                command.future.set_exception(exc)

    def _add(self, command: _Add) -> None:
        stream = command.stream
        try:
            self.engine.add_request(
                stream.request_id,
                stream.prompt_token_ids,
                command.params,
                prompt=stream.prompt,
                arrival_time=stream.arrival,
                multi_modal=stream.multi_modal,
            )
        except Exception as exc:  # a rejection (or any failure) of this request fails it alone
            self._fail(stream, exc)
            return
        self._streams[stream.request_id] = stream
        if not self._deferred_acceptance:
            stream.box.put(RequestAccepted(stream.request_id))

    def _abort(self, request_id: str, *, notify: bool) -> None:
        stream = self._streams.pop(request_id, None)
        self.engine.abort_request(request_id)
        if stream is None:
            return
        snapshot = _aborted_snapshot(stream)
        for sample in snapshot.outputs:
            if sample.finish_reason == "abort":
                self.metrics.observe_finished("abort")
        if notify:
            stream.box.put(snapshot)

    def _dispatch_event(self, event: RequestEvent, now: float) -> None:
        if isinstance(event, RequestOutput):
            self._dispatch(event, now)
            return
        stream = self._streams.get(event.request_id)
        if stream is None:  # aborted meanwhile
            return
        if isinstance(event, RequestFailed):
            del self._streams[event.request_id]
        stream.box.put(event)  # a deferred acceptance, or a failure

    def _dispatch(self, output: RequestOutput, now: float) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:  # aborted or failed already
            return
        try:
            self._observe(stream, output, now)
            stream.last = output
            timeout = self.stream_stall_timeout
            if timeout is not None and not output.finished and stream.box.unread_for(now) > timeout:
                self._abort_stalled(stream, timeout)
                return
            if output.finished:
                del self._streams[output.request_id]
                self.metrics.observe_e2e(now - stream.arrival)
                self.metrics.observe_request(output)
        except Exception as exc:  # a fault in one request's bookkeeping fails that request only
            logger.exception("request %s failed", output.request_id)
            self._streams.pop(output.request_id, None)
            self.engine.abort_request(output.request_id)
            self._fail(stream, exc)
            return
        stream.box.put(output)

    def _abort_stalled(self, stream: _Stream, timeout: float) -> None:
        """Abort a request whose reader left a snapshot unread past `timeout`: its KV is freed now, and the reader
        finds the final `abort` snapshot (replacing the unread one) if it ever reads again."""
        logger.warning(
            "request %s: its reader left a snapshot unread for over %gs (--stream-stall-timeout); aborted",
            stream.request_id,
            timeout,
        )
        self.num_stalled_aborts += 1
        self._abort(stream.request_id, notify=True)

    def _observe(self, stream: _Stream, output: RequestOutput, now: float) -> None:
        num_tokens = sum(len(o.token_ids) for o in output.outputs)
        new_tokens = num_tokens - stream.num_tokens
        if new_tokens <= 0:
            return
        if stream.last_token_time is None:
            self.metrics.observe_first_token(now - stream.arrival)
            if new_tokens > 1:
                self.metrics.observe_inter_token(0.0, new_tokens - 1)
        else:
            self.metrics.observe_inter_token(now - stream.last_token_time, new_tokens)
        stream.num_tokens = num_tokens
        stream.last_token_time = now

    def _fail(self, stream: _Stream, error: Exception) -> None:
        stream.box.put(RequestFailed(stream.request_id, error))

    def _fail_all(self, error: Exception) -> None:
        """Fail every request in the engine with `error` (the engine died or is being rebuilt)."""
        for stream in self._streams.values():
            self._fail(stream, error)
        self._streams.clear()

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
        error = EngineDeadError(f"the engine loop failed: {type(exc).__name__}")
        self._fail_all(error)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                self._fail(command.stream, error)
            elif (
                isinstance(command, _Call | _Sleep | _Wake) and command.future.set_running_or_notify_cancel()
            ):
                command.future.set_exception(error)
        for call in self._pending_sleeps:
            if call.future.set_running_or_notify_cancel():
                call.future.set_exception(error)
        self._pending_sleeps = []


def _settle_all(
    result: concurrent.futures.Future[Any] | None, futures: Sequence[concurrent.futures.Future[None]]
) -> None:
    """Complete `futures` as `result` completes (None: done already; a future: an engine core's answer)."""

    def settle(done: concurrent.futures.Future[Any] | None) -> None:
        error = None if done is None else done.exception()
        for future in futures:
            if not future.set_running_or_notify_cancel():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    if result is None:
        settle(None)
    else:
        result.add_done_callback(settle)


class RequestStream:
    """An accepted request: iterate it for cumulative snapshots; `close` aborts it unless it finished."""

    def __init__(self, llm: AsyncLLM, stream: _Stream) -> None:
        self._llm = llm
        self._stream = stream
        self.request_id = stream.request_id
        self.finished = False
        self._pending = True
        self._closed = False
        llm._admit(stream)

    async def __aiter__(self) -> AsyncGenerator[RequestOutput]:
        """Yield snapshots until the request finishes; raise the error of its `RequestFailed` if it fails.

        Leaving early (break, cancellation, an error) closes the stream, which aborts the request.
        """
        try:
            while not self.finished:
                item = await self._stream.box.get()
                if isinstance(item, RequestAccepted):
                    continue
                if isinstance(item, RequestFailed):
                    self.finished = True  # a failed request is already out of the engine
                    raise item.error
                if self._pending and (item.finished or any(o.token_ids for o in item.outputs)):
                    self._pending = False
                    self._llm._first_token(self._stream.num_seqs)
                if item.finished:
                    self.finished = True
                    self.close()
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Release the request: abort it in the engine unless it finished. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pending:
            self._pending = False
            self._llm._first_token(self._stream.num_seqs)
        self._llm._release(self.request_id, abort=not self.finished)
