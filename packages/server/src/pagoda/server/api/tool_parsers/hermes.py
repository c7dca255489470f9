"""`--tool-call-parser hermes` (Hermes 2 Pro, Qwen 2.5 and 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

from pagoda.server.api.tool_parsers.base import ParsedTools, ToolCallText, calls_of, text_before_tag
from pagoda.server.api.tool_parsers.json_scan import ScanCache, find_tag, scan_object, skip_whitespace

TOOL_CALL_START = "<tool_call>"


class HermesToolParser:
    """Calls are JSON objects inside `<tool_call>` tags; content is the text before the first tag.

    As vLLM's `hermes` parser: text between and after the calls is dropped, and output whose tags hold no call
    is all content.
    """

    def parse(self, text: str, *, final: bool, cache: ScanCache | None = None) -> ParsedTools:
        """Content before the first `<tool_call>`, and the calls of the tags from there."""
        first = find_tag(text, TOOL_CALL_START, 0, cache)
        if first < 0:
            return text_before_tag(text, TOOL_CALL_START, final=final)
        calls: list[ToolCallText] = []
        tag = first
        while tag >= 0:
            start = skip_whitespace(text, tag + len(TOOL_CALL_START))
            if start >= len(text) or text[start] != "{":
                break
            scan = scan_object(text, start, cache)
            found = calls_of(text, [scan], ("arguments",))
            calls += found
            if not found or scan.end is None:
                break
            tag = find_tag(text, TOOL_CALL_START, scan.end, cache)
        if final and not calls:
            return ParsedTools(text)
        return ParsedTools(text[:first], tuple(calls))
