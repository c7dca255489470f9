"""`--tool-call-parser llama3_json` (Llama 3.1 to 3.3): JSON objects with `name` and `parameters`, optionally after
`<|python_tag|>`, several separated by `;`."""

from __future__ import annotations

from pagoda.server.api.tool_parsers.base import ParsedTools, ToolCallText, calls_of
from pagoda.server.api.tool_parsers.json_scan import ScanCache, scan_object, skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser:
    """Output that starts (after whitespace) with `<|python_tag|>` or `{` is calls; any other output is content.

    As vLLM's `llama3_json` parser: the arguments are `parameters` (or `arguments`); output that starts like a
    call but holds none is all content, which a stream therefore sends only at the end.
    """

    def parse(self, text: str, *, final: bool, cache: ScanCache | None = None) -> ParsedTools:
        """No content and the calls, when the text opens with a call; else all content."""
        start = skip_whitespace(text, 0)
        # startswith at an offset, not a slice: a slice would copy the whole text at every delta.
        if text.startswith(PYTHON_TAG, start):
            start = skip_whitespace(text, start + len(PYTHON_TAG))
        elif not text.startswith("{", start):
            if not final and len(text) - start < len(PYTHON_TAG) and PYTHON_TAG.startswith(text[start:]):
                return ParsedTools("")
            return ParsedTools(text)
        calls: list[ToolCallText] = []
        while start < len(text) and text[start] == "{":
            scan = scan_object(text, start, cache)
            found = calls_of(text, [scan], ("parameters", "arguments"))
            calls += found
            if not found or scan.end is None:
                break
            start = skip_whitespace(text, scan.end)
            if start >= len(text) or text[start] != ";":
                break
            start = skip_whitespace(text, start + 1)
        if final and not calls:
            return ParsedTools(text)
        return ParsedTools("", tuple(calls))
