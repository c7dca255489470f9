"""`--tool-call-parser mistral` (Mistral 7B Instruct v0.3, Mistral Nemo, Small): `[TOOL_CALLS][{...}, ...]`."""

from __future__ import annotations

from pagoda.server.api.tool_parsers.base import ParsedTools, calls_of, text_before_tag
from pagoda.server.api.tool_parsers.json_scan import (
    ScanCache,
    find_tag,
    scan_object,
    scan_object_array,
    skip_whitespace,
)

TOOL_CALLS = "[TOOL_CALLS]"


class MistralToolParser:
    """Calls are the JSON array (or single object) after `[TOOL_CALLS]`; content is the text before it.

    The pre-v11 tokenizers' format, as vLLM's `mistral` parser reads it; the v11 `[TOOL_CALLS]name[ARGS]{...}`
    form is not read (its output stays content).
    """

    def parse(self, text: str, *, final: bool, cache: ScanCache | None = None) -> ParsedTools:
        """Content before `[TOOL_CALLS]`, and the calls after it."""
        tag = find_tag(text, TOOL_CALLS, 0, cache)
        if tag < 0:
            return text_before_tag(text, TOOL_CALLS, final=final)
        start = skip_whitespace(text, tag + len(TOOL_CALLS))
        scans = []
        if start < len(text) and text[start] == "[":
            scans = scan_object_array(text, start, cache)
        elif start < len(text) and text[start] == "{":
            scans = [scan_object(text, start, cache)]
        calls = calls_of(text, scans, ("arguments",))
        if final and not calls:
            return ParsedTools(text)
        return ParsedTools(text[:tag], tuple(calls))
