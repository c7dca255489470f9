"""The dashboard's frame producer: one producer for every viewer, bounded per-viewer queues, engine-thread calls."""

from __future__ import annotations

import asyncio
import json

from api_fake_engine import FakeEngine
from pagoda.server.async_llm import AsyncLLM
from pagoda.server.dashboard.producer import FrameProducer
from pagoda.server.engine_client import EngineClient


def test_viewers_share_one_producer_and_a_slow_viewer_drops_frames() -> None:
    async def scenario() -> None:
        engine: EngineClient = FakeEngine()
        llm = AsyncLLM(engine)
        llm.start()
        try:
            producer = FrameProducer(llm, max_fps=50.0, queue_frames=2)
            readers = [producer.subscribe() for _ in range(3)]
            slow = producer.subscribe()  # never reads
            got: list[list[str]] = [[], [], []]

            async def read(i: int) -> None:
                while len(got[i]) < 20:
                    item = await readers[i].next()
                    assert item is not None
                    got[i].append(item)

            await asyncio.wait_for(asyncio.gather(*(read(i) for i in range(3))), 60)
            # Every frame was encoded once, whatever the number of viewers: the readers saw the same frames.
            assert got[0][:10] == got[1][:10] == got[2][:10]
            assert producer.frames_produced <= 20 + 3  # a couple more may have been produced meanwhile
            # The viewer that never reads holds at most its queue's 2 frames; the rest were dropped.
            assert slow.queue.qsize() == 2
            assert slow.dropped >= producer.frames_produced - 3
            frame = json.loads(got[0][0])
            assert frame["type"] == "frame" and frame["replicas"] == []  # the fake engine has no block map
            assert frame["stats"]["running"] == 0
            for sub in [*readers, slow]:
                producer.unsubscribe(sub)
            await producer.close()
            assert producer._task is None or producer._task.done()
        finally:
            llm.shutdown()

    asyncio.run(scenario())


def test_call_on_engine_thread_runs_between_steps_and_reports_errors() -> None:
    async def scenario() -> None:
        import threading

        engine: EngineClient = FakeEngine()
        llm = AsyncLLM(engine)
        llm.start()
        try:
            name = await llm.call_on_engine_thread(lambda e: threading.current_thread().name)
            assert name == "pagoda-engine"

            def boom(e: EngineClient) -> None:
                raise ValueError("view failed")

            try:
                await llm.call_on_engine_thread(boom)
            except ValueError as exc:
                assert str(exc) == "view failed"
            else:
                raise AssertionError("the error did not reach the caller")
            assert llm.is_alive  # a failing view never fails the engine loop
        finally:
            llm.shutdown()

    asyncio.run(scenario())
