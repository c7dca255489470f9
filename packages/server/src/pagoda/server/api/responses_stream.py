"""The event sequence of a streamed /v1/responses: the chat stream's deltas (reasoning, content, tool-call
fragments) turned into OpenAI's output-item events, each with its `sequence_number`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pagoda.server.api.protocol import DeltaMessage
from pagoda.server.api.responses_input import (
    function_call_item,
    message_item,
    new_item_id,
    output_text_part,
    reasoning_item,
)


@dataclass(slots=True)
class EventWriter:
    """Numbers and formats the events of one stream."""

    sequence_number: int = 0

    def emit(self, event_type: str, **payload: Any) -> str:
        """One server-sent event: `event: <type>` and its JSON `data`, numbered in order."""
        data = {"type": event_type, "sequence_number": self.sequence_number, **payload}
        self.sequence_number += 1
        return f"event: {event_type}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass(slots=True)
class _OpenItem:
    kind: Literal["reasoning", "message", "function_call"]
    item_id: str
    output_index: int
    text: str = ""  # reasoning text, message text or call arguments so far
    call_id: str = ""
    name: str = ""


@dataclass(slots=True)
class ItemBuilder:
    """Opens and closes output items as deltas arrive; `items` holds the closed ones, in output order."""

    writer: EventWriter
    items: list[dict[str, Any]] = field(default_factory=list)
    _open: _OpenItem | None = None
    _call_index: int | None = None  # the chat delta index of the open call

    def feed(self, delta: DeltaMessage) -> list[str]:
        """The events of one chat delta."""
        events: list[str] = []
        if delta.reasoning_content:
            events += self._ensure("reasoning")
            events += self._append(delta.reasoning_content)
        if delta.content:
            events += self._ensure("message")
            events += self._append(delta.content)
        for call in delta.tool_calls or ():
            if call.index != self._call_index:
                events += self.close()
                self._call_index = call.index
                events += self._start_call(call.id or new_item_id("call"), call.function.name or "")
            if call.function.arguments:
                events += self._append(call.function.arguments)
        return events

    def close(self) -> list[str]:
        """Close the open item, if any: its done events."""
        item, self._open = self._open, None
        if item is None:
            return []
        w = self.writer
        base = {"item_id": item.item_id, "output_index": item.output_index}
        if item.kind == "reasoning":
            done = reasoning_item(item.item_id, item.text)
            events = [w.emit("response.reasoning_text.done", **base, content_index=0, text=item.text)]
        elif item.kind == "message":
            done = message_item(item.item_id, item.text, "completed")
            part = output_text_part(item.text)
            events = [
                w.emit("response.output_text.done", **base, content_index=0, text=item.text, logprobs=[]),
                w.emit("response.content_part.done", **base, content_index=0, part=part),
            ]
        else:
            done = function_call_item(item.item_id, item.call_id, item.name, item.text)
            events = [
                w.emit("response.function_call_arguments.done", **base, name=item.name, arguments=item.text)
            ]
            self._call_index = None
        self.items.append(done)
        events.append(w.emit("response.output_item.done", output_index=item.output_index, item=done))
        return events

    def _ensure(self, kind: Literal["reasoning", "message"]) -> list[str]:
        if self._open is not None and self._open.kind == kind:
            return []
        events = self.close()
        prefix = "rs" if kind == "reasoning" else "msg"
        item = _OpenItem(kind, new_item_id(prefix), len(self.items))
        self._open = item
        w = self.writer
        if kind == "reasoning":
            added = reasoning_item(item.item_id, "", "in_progress")
            events.append(w.emit("response.output_item.added", output_index=item.output_index, item=added))
            return events
        added = message_item(item.item_id, None, "in_progress")
        events.append(w.emit("response.output_item.added", output_index=item.output_index, item=added))
        events.append(
            w.emit(
                "response.content_part.added",
                item_id=item.item_id,
                output_index=item.output_index,
                content_index=0,
                part=output_text_part(""),
            )
        )
        return events

    def _start_call(self, call_id: str, name: str) -> list[str]:
        item = _OpenItem("function_call", new_item_id("fc"), len(self.items), call_id=call_id, name=name)
        self._open = item
        added = function_call_item(item.item_id, call_id, name, "", "in_progress")
        return [self.writer.emit("response.output_item.added", output_index=item.output_index, item=added)]

    def _append(self, text: str) -> list[str]:
        item = self._open
        assert item is not None
        item.text += text
        base = {"item_id": item.item_id, "output_index": item.output_index}
        if item.kind == "reasoning":
            return [self.writer.emit("response.reasoning_text.delta", **base, content_index=0, delta=text)]
        if item.kind == "message":
            return [
                self.writer.emit(
                    "response.output_text.delta", **base, content_index=0, delta=text, logprobs=[]
                )
            ]
        return [self.writer.emit("response.function_call_arguments.delta", **base, delta=text)]
