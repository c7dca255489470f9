"""`tool_choice` "required" and named functions: the JSON schemas that structured output enforces, and the parsers
that read the calls back from the constrained output (no `--tool-call-parser` needed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagoda.server.api.tool_fields import ChatTool
from pagoda.server.api.tool_parsers.base import ParsedTools, ToolCallText, calls_of
from pagoda.server.api.tool_parsers.json_scan import ScanCache, scan_object_array, skip_whitespace

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # the arguments of a function declared without parameters


def parameters_schema(tool: ChatTool) -> dict[str, Any]:
    """The JSON schema of a tool's arguments."""
    return tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT


def required_schema(tools: Sequence[ChatTool], *, parallel: bool) -> dict[str, Any]:
    """vLLM's schema of `tool_choice: "required"`: an array of at least one `{name, parameters}` object, each
    one of the tools (at most one element when `parallel` is false). The tools' `$defs` are lifted to the root,
    where their `#/$defs/...` references point; ValueError when two tools define one name differently."""
    defs: dict[str, Any] = {}
    alternatives: list[dict[str, Any]] = []
    for tool in tools:
        parameters = dict(parameters_schema(tool))
        lifted = parameters.pop("$defs", {})
        if not isinstance(lifted, dict):
            raise ValueError(f"tools: {tool.function.name}: $defs must be an object")
        for key, value in lifted.items():
            if defs.setdefault(key, value) != value:
                raise ValueError(f"tools: two tools define $defs.{key} differently")
        alternatives.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class NamedToolCall:
    """A named `tool_choice`: the whole output is the arguments of that function."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, *, final: bool, cache: ScanCache | None = None) -> ParsedTools:
        """One call of the named function, whose arguments are all of `text`."""
        return ParsedTools("", (ToolCallText(self.name, text),))


class RequiredToolCalls:
    """`tool_choice: "required"`: the output is a JSON array of `{name, parameters}` objects."""

    def parse(self, text: str, *, final: bool, cache: ScanCache | None = None) -> ParsedTools:
        """The calls of the array; output that holds none (cut short) is content once final."""
        start = skip_whitespace(text, 0)
        calls: list[ToolCallText] = []
        if start < len(text) and text[start] == "[":
            calls = calls_of(text, scan_object_array(text, start, cache), ("parameters",))
        if final and not calls:
            return ParsedTools(text)
        return ParsedTools("", tuple(calls))
