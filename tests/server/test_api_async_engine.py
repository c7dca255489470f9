"""AsyncLLM without HTTP: per-request fault isolation, abort on early exit, admission limits, shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import pytest
from api_fake_engine import FakeEngine
from pagoda.server.async_llm import AsyncLLM
from pagoda.server.client_stream import EngineDrainingError, EngineOverloadedError
from pagoda.server.config import ServingConfig
from pagoda.server.engine_client import EngineClient
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling_params import SamplingParams


class CorruptingEngine(FakeEngine):
    """Returns a malformed snapshot for request "bad", as a bug in one request's bookkeeping would."""

    def step(self) -> list[RequestOutput]:
        """The fake's step with the "bad" request's outputs replaced by None."""
        outputs = super().step()
        broken: Any = None
        return [dataclasses.replace(o, outputs=broken) if o.request_id == "bad" else o for o in outputs]


def run(
    engine: EngineClient,
    body: Callable[[AsyncLLM], Awaitable[None]],
    rebuild: Callable[[], EngineClient] | None = None,
    **kwargs: Any,
) -> AsyncLLM:
    """Start an AsyncLLM over `engine` (`rebuild`: what replaces it after a death), run `body`, shut it down."""
    llm = AsyncLLM(engine, ServingConfig(served_model_name="test-model", **kwargs), rebuild=rebuild)

    async def main() -> None:
        llm.start()
        try:
            await body(llm)
        finally:
            await asyncio.to_thread(llm.shutdown)

    asyncio.run(main())
    return llm


async def last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The final snapshot of a stream."""
    final = None
    async for output in outputs:
        final = output
    assert final is not None
    return final


def test_a_fault_in_one_request_fails_it_alone() -> None:
    """A request whose snapshot breaks the bookkeeping fails; a concurrent one finishes; the loop lives on."""
    engine = CorruptingEngine()
    params = SamplingParams(max_tokens=5)

    async def body(llm: AsyncLLM) -> None:
        good = asyncio.ensure_future(last(llm.generate("good", [1, 2, 3], params)))
        with pytest.raises(TypeError):
            await last(llm.generate("bad", [1, 2, 3], params))
        assert (await good).outputs[0].finish_reason == "length"
        assert llm.is_alive
        assert (await last(llm.generate("after", [4], params))).finished

    run(engine, body)
    assert "bad" in engine.aborted and "bad" not in engine.requests


def test_leaving_the_stream_early_aborts_the_request() -> None:
    """Breaking out of generate() aborts the engine request before its next step."""
    engine = FakeEngine(max_model_len=4096, step_seconds=0.001)

    async def body(llm: AsyncLLM) -> None:
        async with aclosing(llm.generate("leaver", [1], SamplingParams(max_tokens=4000))) as outputs:
            async for _ in outputs:
                break
        while "leaver" in engine.requests:
            await asyncio.sleep(0.001)
        assert llm.num_active_requests == 0 and llm.num_pending_sequences == 0

    run(engine, body)
    assert engine.aborted == ["leaver"]


def test_rejection_and_overload_and_draining() -> None:
    """An engine rejection raises its ValueError; a full queue raises overload; draining refuses new work."""
    engine = FakeEngine(max_num_seqs=1, max_model_len=4096, step_seconds=0.001)

    async def body(llm: AsyncLLM) -> None:
        with pytest.raises(ValueError, match="too long"):
            await llm.add_request("huge", [1], SamplingParams(max_tokens=5000))
        first = await llm.add_request("first", [1], SamplingParams(max_tokens=3000))
        async for output in first:  # running: it has a token now
            if output.outputs[0].token_ids:
                break
        second = await llm.add_request("second", [1], SamplingParams(max_tokens=2))  # waits for the one seat
        assert llm.num_pending_sequences == 1
        with pytest.raises(EngineOverloadedError):
            await llm.add_request("third", [1], SamplingParams(max_tokens=2, n=2))
        first.close()  # frees the seat: the second runs and finishes
        assert (await last(aiter(second))).outputs[0].finish_reason == "length"
        await llm.drain(1.0)
        with pytest.raises(EngineDrainingError):
            await llm.add_request("late", [1], SamplingParams())

    run(engine, body, max_waiting_requests=2)
    assert engine.aborted == ["first"]
