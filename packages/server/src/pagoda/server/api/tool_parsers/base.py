"""What every tool-call parser returns, and the stream that turns a choice's growing text into tool-call deltas.

A parser maps a (possibly unfinished) text to its content and its calls so far. On a growing text its content
and the list of calls only ever grow, and so does each call's arguments text (the raw text of the model's
arguments value): the stream sends the growth, so reassembled deltas equal the non-streamed response.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagoda.server.api.tool_fields import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from pagoda.server.api.tool_parsers.json_scan import ObjectScan, ScanCache


@dataclass(frozen=True, slots=True)
class ToolCallText:
    """One call as parsed: the function's name and the raw JSON text of its arguments (unfinished while the
    model writes them)."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedTools:
    """A text split into its content (what is not a call) and its calls."""

    content: str
    calls: tuple[ToolCallText, ...] = ()


class ToolCallParser(Protocol):
    """Splits a (possibly partial) output text into content and tool calls."""

    def parse(self, text: str, *, final: bool, cache: ScanCache | None = None) -> ParsedTools:
        """Content and calls of `text`; unless `final`, a tail that may still open a call is held back.

        `cache` (a stream's, over its growing text) lets the scans resume; the answer is the same without it.
        """
        ...


def new_tool_call_id() -> str:
    """A fresh call id in vLLM's format."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_calls(calls: Sequence[ToolCallText]) -> list[ToolCall]:
    """The response's calls, each with a fresh id."""
    return [
        ToolCall(id=new_tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (it may still become the tag)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def text_before_tag(text: str, tag: str, *, final: bool) -> ParsedTools:
    """All of `text` as content when it holds no `tag`, less a tail that may still become the tag unless final."""
    return ParsedTools(text if final else text[: len(text) - partial_tag_len(text, tag)])


def calls_of(text: str, scans: Sequence[ObjectScan], argument_keys: tuple[str, ...]) -> list[ToolCallText]:
    """The calls of scanned objects with a `name` string, up to the first that is not (yet) one or not finished.

    The arguments are the raw text of the first of `argument_keys` present (to the end of `text` while
    unfinished), or `{}` once an object closes without them.
    """
    calls: list[ToolCallText] = []
    for scan in scans:
        name = scan.member("name")
        if name is None or name.end is None:
            break
        value = json.loads(text[name.start : name.end])
        if not isinstance(value, str):
            break
        args = next((m for key in argument_keys if (m := scan.member(key)) is not None), None)
        unfinished = "" if scan.end is None else "{}"
        arguments = unfinished if args is None else text[args.start : args.end]
        calls.append(ToolCallText(value, arguments))
        if scan.end is None:
            break
    return calls


@dataclass(slots=True)
class _SentCall:
    id: str
    arguments_len: int


@dataclass(slots=True)
class ToolCallStream:
    """One streamed choice's parser state: `delta` turns its growing text into new content and call deltas."""

    parser: ToolCallParser
    max_calls: int | None = None  # 1 with parallel_tool_calls false
    content_len: int = 0
    sent: list[_SentCall] = field(default_factory=list)
    # The choice's text only grows: its scans resume here, so a stream costs work linear in its text.
    cache: ScanCache = field(default_factory=ScanCache)

    @property
    def called(self) -> bool:
        """Whether a call has been sent."""
        return bool(self.sent)

    def delta(self, text: str, *, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content and call deltas that `text`, the choice's whole text so far, adds to what was sent."""
        parsed = self.parser.parse(text, final=finished, cache=self.cache)
        content = parsed.content[self.content_len :]
        self.content_len = max(self.content_len, len(parsed.content))
        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(parsed.calls[: self.max_calls]):
            if index == len(self.sent):
                self.sent.append(_SentCall(new_tool_call_id(), len(call.arguments)))
                function = DeltaFunctionCall(name=call.name, arguments=call.arguments)
                deltas.append(
                    DeltaToolCall(index=index, id=self.sent[index].id, type="function", function=function)
                )
            elif len(call.arguments) > self.sent[index].arguments_len:
                fragment = call.arguments[self.sent[index].arguments_len :]
                self.sent[index].arguments_len = len(call.arguments)
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment)))
        return content, deltas
