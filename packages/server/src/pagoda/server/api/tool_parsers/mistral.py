"""`--tool-call-parser mistral` (Mistral 7B Instruct v0.3, Mistral Nemo, Small): `[TOOL_CALLS][{...}, ...]`, and
the v11 tokenizers' `[TOOL_CALLS]name[ARGS]{...}` (one `[TOOL_CALLS]` per call)."""

from __future__ import annotations

import re

from pagoda.server.api.tool_parsers.base import ParsedTools, ToolCallText, calls_of, text_before_tag
from pagoda.server.api.tool_parsers.json_scan import (
    JsonScanError,
    ScanCache,
    find_tag,
    scan_object,
    scan_object_array,
    skip_whitespace,
    value_end,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names (and the dots some templates use)


class MistralToolParser:
    """Calls are the JSON array (or single object) after `[TOOL_CALLS]`; content is the text before it.

    The pre-v11 tokenizers' format, as vLLM's `mistral` parser reads it; and v11's, where each call is
    `[TOOL_CALLS]` + its name + `[ARGS]` + its arguments object.
    """

    def parse(self, text: str, *, final: bool, cache: ScanCache | None = None) -> ParsedTools:
        """Content before `[TOOL_CALLS]`, and the calls after it."""
        tag = find_tag(text, TOOL_CALLS, 0, cache)
        if tag < 0:
            return text_before_tag(text, TOOL_CALLS, final=final)
        start = skip_whitespace(text, tag + len(TOOL_CALLS))
        if start < len(text) and text[start] not in "[{":
            return _parse_v11(text, tag, final=final, cache=cache)
        scans = []
        if start < len(text) and text[start] == "[":
            scans = scan_object_array(text, start, cache)
        elif start < len(text) and text[start] == "{":
            scans = [scan_object(text, start, cache)]
        calls = calls_of(text, scans, ("arguments",))
        if final and not calls:
            return ParsedTools(text)
        return ParsedTools(text[:tag], tuple(calls))


def _parse_v11(text: str, tag: int, *, final: bool, cache: ScanCache | None) -> ParsedTools:
    """`[TOOL_CALLS]name[ARGS]{...}` calls from `tag` on: each call is listed once its `[ARGS]` is written, its
    arguments growing until the object closes. Text that breaks the form ends the calls (with none, all of it
    is content once final)."""
    calls: list[ToolCallText] = []
    at = tag
    while True:
        name_start = at + len(TOOL_CALLS)
        args_tag = find_tag(text, ARGS, name_start, cache)
        if args_tag < 0:  # the name is still being written (or the form is broken)
            break
        name = text[name_start:args_tag].strip()
        if _NAME.fullmatch(name) is None:
            break
        args_start = skip_whitespace(text, args_tag + len(ARGS))
        if args_start >= len(text) or text[args_start] != "{":  # not yet, or not an arguments object
            break
        try:
            end = value_end(text, args_start, cache)
        except JsonScanError:
            break
        calls.append(ToolCallText(name, text[args_start:] if end is None else text[args_start:end]))
        if end is None:
            break
        nxt = skip_whitespace(text, end)
        if not text.startswith(TOOL_CALLS, nxt):
            break
        at = nxt
    if final and not calls:
        return ParsedTools(text)
    return ParsedTools(text[:tag], tuple(calls))
