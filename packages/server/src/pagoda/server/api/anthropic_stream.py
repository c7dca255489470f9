"""The event sequence of a streamed /v1/messages: the chat stream's deltas (reasoning, content, tool-call
fragments) turned into Anthropic's content-block events, and keep-alive pings while nothing else is sent."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pagoda.server.api.anthropic_input import new_tool_use_id, tool_use_block
from pagoda.server.api.protocol import DeltaMessage
from pydantic import JsonValue

T = TypeVar("T")

PING_SECONDS = 10.0  # a ping after this long without another event keeps proxies from closing the stream


def event(event_type: str, **payload: Any) -> str:
    """One server-sent event: `event: <type>` and its JSON `data` (whose `type` repeats it, as Anthropic's)."""
    data = json.dumps({"type": event_type, **payload}, ensure_ascii=False)
    return f"event: {event_type}\ndata: {data}\n\n"


PING = event("ping")


@dataclass(slots=True)
class BlockWriter:
    """Opens and closes content blocks as chat deltas arrive: one thinking block, one text block, one tool_use
    block per call, each with its `index`, in output order."""

    num_blocks: int = 0
    called: bool = False  # whether a tool_use block was opened
    _open: Literal["thinking", "text", "tool_use"] | None = None
    _call_index: int | None = None  # the chat delta index of the open call

    def feed(self, delta: DeltaMessage) -> list[str]:
        """The events of one chat delta."""
        events: list[str] = []
        if delta.reasoning_content:
            events += self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events += self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content})
        if delta.content:
            events += self._ensure("text", {"type": "text", "text": ""})
            events += self._delta({"type": "text_delta", "text": delta.content})
        for call in delta.tool_calls or ():
            if call.index != self._call_index or self._open != "tool_use":
                events += self.close()
                self._call_index = call.index
                self.called = True
                block = tool_use_block(new_tool_use_id(), call.function.name or "", {})
                events += self._start("tool_use", block)
            if call.function.arguments:
                events += self._delta({"type": "input_json_delta", "partial_json": call.function.arguments})
        return events

    def close(self) -> list[str]:
        """Close the open block, if any."""
        if self._open is None:
            return []
        self._open = None
        return [event("content_block_stop", index=self.num_blocks - 1)]

    def _ensure(self, kind: Literal["thinking", "text"], block: dict[str, JsonValue]) -> list[str]:
        if self._open == kind:
            return []
        return self.close() + self._start(kind, block)

    def _start(self, kind: Literal["thinking", "text", "tool_use"], block: dict[str, JsonValue]) -> list[str]:
        self._open = kind
        self.num_blocks += 1
        return [event("content_block_start", index=self.num_blocks - 1, content_block=block)]

    def _delta(self, delta: dict[str, JsonValue]) -> list[str]:
        return [event("content_block_delta", index=self.num_blocks - 1, delta=delta)]


@dataclass(slots=True)
class _Pump:
    """What the keep-alive pump hands over: an item, the end, or the source's exception."""

    item: Any = None
    done: bool = False
    error: Exception | None = field(default=None)


async def keepalive(source: AsyncGenerator[T], interval: float) -> AsyncGenerator[T | None]:
    """`source`'s items, and None each time `interval` seconds pass without one (the caller sends a ping).

    A task reads `source` into a one-slot queue, so a reader that stops reading stops the source too. Closing
    this generator cancels the task, which closes `source` (its `finally` aborts the engine requests).
    """
    queue: asyncio.Queue[_Pump] = asyncio.Queue(maxsize=1)

    async def pump() -> None:
        async with aclosing(source):
            try:
                async for item in source:
                    await queue.put(_Pump(item))
            except Exception as exc:
                await queue.put(_Pump(error=exc))
            else:
                await queue.put(_Pump(done=True))

    task = asyncio.ensure_future(pump())
    try:
        while True:
            try:
                async with asyncio.timeout(interval):  # a timer, not wait_for's task per item
                    got = await queue.get()
            except TimeoutError:
                yield None
                continue
            if got.error is not None:
                raise got.error
            if got.done:
                return
            yield got.item
    finally:
        # Synchronous (as merge_streams' own clean-up): under a cancelled scope every await would raise again.
        task.cancel()
