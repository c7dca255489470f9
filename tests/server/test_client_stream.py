"""The one vocabulary of a request's life (client_stream.py), end to end through `AsyncLLM`: an acceptance, a
failure or a death that an engine reports reaches the coroutine waiting on the request as the same words, whether
the engine is in-process or answers later as an engine core does (`defers_acceptance`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest
from api_fake_engine import FAIL_STEP_MARKER, FakeEngine
from pagoda.scheduler import RequestRejectedError
from pagoda.server.api.errors import REPLICA_FAILED_MESSAGE, APIError
from pagoda.server.api.serving_base import to_api_error
from pagoda.server.async_llm import AsyncLLM
from pagoda.server.client_stream import (
    EngineDeadError,
    EngineRestartedError,
    ReplicaDeadError,
    RequestAccepted,
    RequestEvent,
    RequestFailed,
)
from pagoda.server.multimodal import MultiModalInputs
from pagoda.server.outputs import EngineStats, RequestOutput
from pagoda.server.sampling_params import SamplingParams
from test_api_async_engine import run
from transformers import PreTrainedTokenizerBase

pytestmark = pytest.mark.timeout(60)  # a lost event would leave its reader waiting forever


class DeferringEngine:
    """A `FakeEngine` that answers each add out of a later `step`, as a remote engine core does: `RequestAccepted`,
    or `RequestFailed` for an id in `to_reject` (a core's `Rejected`); `lose` fails a request as its replica's
    death does (engine thread only)."""

    defers_acceptance = True

    def __init__(self, fake: FakeEngine) -> None:
        self.fake = fake
        self.tokenizer: PreTrainedTokenizerBase = fake.tokenizer
        self.model_name = fake.model_name
        self.max_model_len = fake.max_model_len
        self.vocab_size = fake.vocab_size
        self.num_kv_blocks = fake.num_kv_blocks
        self.block_size = fake.block_size
        self.supported_tasks = fake.supported_tasks
        self.to_reject: set[str] = set()
        self.errors: list[Exception] = []  # every error this engine reported, in order
        self.aborted: list[str] = []  # every id `abort_request` was called with
        self._answers: list[RequestEvent] = []

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
        """Queue the request; its answer comes out of the next step."""
        if request_id in self.to_reject:
            self._fail(request_id, RequestRejectedError("rejected by the deferring engine", "prompt"))
            return
        self.fake.add_request(request_id, prompt_token_ids, params, prompt=prompt, arrival_time=arrival_time)
        self._answers.append(RequestAccepted(request_id))

    def lose(self, request_id: str) -> None:
        """Drop the request as a dead replica would (no abort): it fails out of the next step."""
        del self.fake.requests[request_id]
        self._fail(request_id, ReplicaDeadError("engine replica 0 died (killed by the test)"))

    def _fail(self, request_id: str, error: Exception) -> None:
        self.errors.append(error)
        self._answers.append(RequestFailed(request_id, error))

    def abort_request(self, request_id: str) -> None:
        """Abort in the fake (and note the call, known id or not)."""
        self.aborted.append(request_id)
        self.fake.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while an answer or a request is out."""
        return bool(self._answers) or self.fake.has_unfinished_requests()

    def step(self) -> list[RequestEvent]:
        """The answers first (a core sends them before its next outputs), then the fake's step."""
        answers, self._answers = self._answers, []
        return [*answers, *self.fake.step()]

    def get_stats(self) -> EngineStats:
        """The fake's stats."""
        return self.fake.get_stats()

    def check_health(self) -> None:
        """Never dies on its own."""

    def close(self) -> None:
        """Holds nothing."""


async def drain_stream(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """Read a stream to its end; its last output (None if it had none)."""
    final = None
    async for output in outputs:
        final = output
    return final


def test_a_deferred_acceptance_and_a_replica_death_reach_the_waiting_coroutine() -> None:
    """An admission waits for the engine's `RequestAccepted` out of a step; a `RequestFailed` ends that request's
    stream with the engine's very error (a 503 to retry), while another request finishes and nothing is aborted."""
    engine = DeferringEngine(FakeEngine(max_model_len=4096, step_seconds=0.001))

    async def body(llm: AsyncLLM) -> None:
        steps = engine.fake.num_steps
        lost = await llm.add_request("lost", [1], SamplingParams(max_tokens=3000))
        assert engine.fake.num_steps > steps  # accepted out of a step, not when added
        kept = asyncio.ensure_future(drain_stream(llm.generate("kept", [2], SamplingParams(max_tokens=5))))
        outputs = aiter(lost)
        assert (await anext(outputs)).request_id == "lost"
        await llm.call_on_engine_thread(lambda _: engine.lose("lost"))
        with pytest.raises(ReplicaDeadError) as caught:
            await drain_stream(outputs)
        assert caught.value is engine.errors[-1]
        error = to_api_error(caught.value)
        assert isinstance(error, APIError) and (error.status, error.message) == (503, REPLICA_FAILED_MESSAGE)
        final = await kept
        assert final is not None and final.outputs[0].finish_reason == "length"
        assert llm.is_alive and llm.num_active_requests == 0 and llm.num_pending_sequences == 0

    run(engine, body)
    assert engine.aborted == []  # a failed request is out of the engine already: nobody aborts it


def test_a_deferred_rejection_fails_the_admission() -> None:
    """A `RequestFailed` instead of the acceptance raises the engine's error from the admission itself (a 400
    naming the field), counts nothing, and the next request is served."""
    engine = DeferringEngine(FakeEngine())
    engine.to_reject.add("bad")

    async def body(llm: AsyncLLM) -> None:
        with pytest.raises(RequestRejectedError) as caught:
            await llm.add_request("bad", [1], SamplingParams(max_tokens=5))
        assert caught.value is engine.errors[-1] and caught.value.param == "prompt"
        assert llm.num_active_requests == 0 and llm.num_pending_sequences == 0
        final = await drain_stream(llm.generate("good", [1], SamplingParams(max_tokens=3)))
        assert final is not None and final.finished

    run(engine, body)
    assert engine.aborted == []


@pytest.mark.parametrize("rebuilt", [False, True], ids=["dead", "restarted"])
def test_a_death_ends_every_stream_with_its_error(rebuilt: bool) -> None:
    """A step that raised fails every in-flight stream: `EngineRestartedError` when the engine is rebuilt (it then
    serves on), `EngineDeadError` when it is not (every later admission or call gets EngineDeadError too)."""
    fresh = FakeEngine()
    expected = EngineRestartedError if rebuilt else EngineDeadError

    async def body(llm: AsyncLLM) -> None:
        waiting = await llm.add_request("waiting", [1], SamplingParams(max_tokens=3000))
        outputs = aiter(waiting)
        await anext(outputs)  # running
        culprit = await llm.add_request("culprit", [2], SamplingParams(max_tokens=5), prompt=FAIL_STEP_MARKER)
        for stream in (outputs, aiter(culprit)):
            with pytest.raises(EngineDeadError) as caught:
                await drain_stream(stream)
            assert type(caught.value) is expected
        assert llm.num_active_requests == 0
        if rebuilt:
            # The streams fail first (clients may retry at once), then the engine thread rebuilds: on a loaded
            # machine the rebuild can still be under way when the errors arrive.
            for _ in range(1000):
                if llm.engine_restarts:
                    break
                await asyncio.sleep(0.01)
            assert llm.is_alive and llm.engine is fresh
            final = await drain_stream(llm.generate("after", [3], SamplingParams(max_tokens=3)))
            assert final is not None and final.finished
            return
        assert not llm.is_alive
        with pytest.raises(EngineDeadError):
            await llm.add_request("after", [3], SamplingParams(max_tokens=3))
        with pytest.raises(EngineDeadError):
            await llm.call_on_engine_thread(lambda engine: engine.get_stats())

    run(FakeEngine(max_model_len=4096, step_seconds=0.001), body, (lambda: fresh) if rebuilt else None)


def test_a_drain_abort_ends_the_stream_with_an_abort_output() -> None:
    """A drain past its timeout aborts what is left: the engine frees the request and its stream ends with a
    finished output whose sample says `abort`."""
    engine = FakeEngine(max_model_len=4096, step_seconds=0.001)

    async def body(llm: AsyncLLM) -> None:
        stream = await llm.add_request("long", [1], SamplingParams(max_tokens=3000))
        reader = asyncio.ensure_future(drain_stream(aiter(stream)))
        await llm.drain(0.05)
        final = await reader
        assert final is not None and final.finished and final.outputs[0].finish_reason == "abort"
        assert llm.num_active_requests == 0

    run(engine, body)
    assert engine.aborted == ["long"]
