"""An incremental JSON scanner: where the members of a (possibly unfinished) object or array lie in a text.

Tool-call parsers stream a call's arguments as the raw text of its `arguments` value grows, so they need the
value's span before the object closes; `json.loads` only answers once the text is whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
_LITERAL_CHARS = frozenset("-+.0123456789eEtruefalsn")


class JsonScanError(ValueError):
    """The text is not JSON at the scanned position (an unfinished text is not an error)."""


@dataclass(frozen=True, slots=True)
class Member:
    """One member of an object: its key and the span of its raw value text (`end` None while unfinished)."""

    key: str
    start: int
    end: int | None


@dataclass(frozen=True, slots=True)
class ObjectScan:
    """The members of an object found so far, the index after its `}` (None while unfinished), and whether the
    text stopped being JSON (the members found before stay: a stream may have sent them already)."""

    members: tuple[Member, ...]
    end: int | None
    broken: bool = False

    def member(self, key: str) -> Member | None:
        """The first member named `key`, if it has started."""
        return next((m for m in self.members if m.key == key), None)


def skip_whitespace(text: str, i: int) -> int:
    """The index of the first non-whitespace character at or after `i` (len(text) if none)."""
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Index after the string opening at `i` (text[i] == '"'), or None if the text ends inside it."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        if c < " ":
            raise JsonScanError(f"a raw control character inside a string at {j}")
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index after the JSON value starting at `i` (no leading whitespace), or None if the text ends first.

    Containers are matched by depth only (their inside is checked by `json.loads` once whole); a literal is only
    known to end when a character follows it.
    """
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        closers: list[str] = []
        j = i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                closers.append("}" if c == "{" else "]")
            elif c in "}]":
                if not closers or closers.pop() != c:
                    raise JsonScanError(f"unbalanced {c!r} at {j}")
                if not closers:
                    return j + 1
            j += 1
        return None
    if c not in _LITERAL_CHARS:
        raise JsonScanError(f"unexpected {c!r} at {i}")
    j = i
    while j < len(text) and text[j] in _LITERAL_CHARS:
        j += 1
    return j if j < len(text) else None


def scan_object(text: str, i: int) -> ObjectScan:
    """The members of the object opening at `i` (text[i] == '{'), as far as the text goes and is JSON.

    A value that is not JSON is kept as a member that never ends, so that its span only ever grows.
    """
    members: list[Member] = []
    try:
        return _scan_members(text, i, members)
    except JsonScanError:
        return ObjectScan(tuple(members), None, broken=True)


def _scan_members(text: str, i: int, members: list[Member]) -> ObjectScan:
    if text[i] != "{":
        raise JsonScanError(f"expected an object at {i}")
    j = skip_whitespace(text, i + 1)
    if j < len(text) and text[j] == "}":
        return ObjectScan((), j + 1)
    while j < len(text):
        if text[j] != '"':
            raise JsonScanError(f"expected a key at {j}")
        key_end = _string_end(text, j)
        if key_end is None:
            break
        key = json.loads(text[j:key_end])
        j = skip_whitespace(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            raise JsonScanError(f"expected ':' at {j}")
        start = skip_whitespace(text, j + 1)
        if start >= len(text):
            break
        members.append(Member(key, start, None))
        end = value_end(text, start)
        if end is None:
            break
        members[-1] = Member(key, start, end)
        j = skip_whitespace(text, end)
        if j >= len(text):
            break
        if text[j] == "}":
            return ObjectScan(tuple(members), j + 1)
        if text[j] != ",":
            raise JsonScanError(f"expected ',' or '}}' at {j}")
        j = skip_whitespace(text, j + 1)
    return ObjectScan(tuple(members), None)


def scan_object_array(text: str, i: int) -> list[ObjectScan]:
    """The objects of the array opening at `i` (text[i] == '['), as far as the text goes and is JSON; the last
    may be unfinished or broken. Scanning stops at the first element that is not an object."""
    objects: list[ObjectScan] = []
    j = skip_whitespace(text, i + 1)
    while j < len(text) and text[j] == "{":
        scan = scan_object(text, j)
        objects.append(scan)
        if scan.end is None:
            break
        j = skip_whitespace(text, scan.end)
        if j >= len(text) or text[j] != ",":
            break
        j = skip_whitespace(text, j + 1)
    return objects
