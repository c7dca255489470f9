"""An incremental JSON scanner: where the members of a (possibly unfinished) object or array lie in a text.

Tool-call parsers stream a call's arguments as the raw text of its `arguments` value grows, so they need the
value's span before the object closes; `json.loads` only answers once the text is whole.

A stream's text only ever grows, so a `ScanCache` kept across its calls lets each scan resume where the previous
one stopped: a streamed choice costs work linear in its text instead of re-scanning it at every delta. Without
a cache (one-off parses) every scan starts afresh; the answers are the same either way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class _ValueState:
    """Where the scan of one value stopped: the next index to read, open containers, inside a string."""

    j: int
    closers: list[str] = field(default_factory=list)
    in_string: bool = False
    escaped: bool = False
    end: int | None = None  # known once the value ended
    error: JsonScanError | None = None  # known once the text stopped being JSON (it stays so as it grows)


@dataclass(slots=True)
class _ObjectState:
    """Where the scan of one object stopped: its finished members and the index of the next key."""

    done: list[Member] = field(default_factory=list)
    j: int | None = None  # the next key's index (None: the opening brace is not read yet)
    partial: Member | None = None  # the member being read when the scan stopped
    result: ObjectScan | None = None  # final once the object closed or broke


@dataclass(slots=True)
class ScanCache:
    """Resumable scan states of one growing text (a stream's): keyed by where each value or search starts.

    Valid only while the text it is used with grows by appending; `scanned` counts the characters the scanner
    read, the work a test can bound without a clock.
    """

    scanned: int = 0
    _values: dict[int, _ValueState] = field(default_factory=dict)
    _objects: dict[int, _ObjectState] = field(default_factory=dict)
    _finds: dict[tuple[str, int], int] = field(default_factory=dict)  # (tag, start) -> where to search on
    _found: dict[tuple[str, int], int] = field(default_factory=dict)  # (tag, start) -> its first match

    def find(self, text: str, tag: str, start: int) -> int:
        """`text.find(tag, start)`, searching only the text that arrived since the last call (-1 if absent)."""
        key = (tag, start)
        found = self._found.get(key)
        if found is not None:
            return found
        since = self._finds.get(key, start)
        position = text.find(tag, since)
        self.scanned += max(0, len(text) - since)
        if position >= 0:
            self._found[key] = position
            return position
        # A match may still begin in the last len(tag) - 1 characters.
        self._finds[key] = max(start, len(text) - len(tag) + 1)
        return -1


def find_tag(text: str, tag: str, start: int, cache: ScanCache | None) -> int:
    """`text.find(tag, start)`, resumed through `cache` when one is given."""
    return text.find(tag, start) if cache is None else cache.find(text, tag, start)


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


def value_end(text: str, i: int, cache: ScanCache | None = None) -> int | None:
    """Index after the JSON value starting at `i` (no leading whitespace), or None if the text ends first.

    Containers are matched by depth only (their inside is checked by `json.loads` once whole); a literal is only
    known to end when a character follows it. With `cache`, the scan resumes where the last one on `i` stopped.
    """
    if i >= len(text):
        return None
    cache = cache or ScanCache()
    state = cache._values.get(i)
    if state is None:
        state = cache._values[i] = _ValueState(i)
    if state.error is not None:
        raise state.error
    if state.end is None:
        start = state.j
        try:
            _resume_value(text, i, state)
        except JsonScanError as exc:
            state.error = exc
            raise
        finally:
            cache.scanned += state.j - start
    return state.end


def _resume_value(text: str, i: int, state: _ValueState) -> None:
    """Advance `state` (the value opening at `i`) over the text that arrived; sets `end` once it closes."""
    opener = text[i]
    j = state.j
    if opener not in '"{[':
        if opener not in _LITERAL_CHARS:
            raise JsonScanError(f"unexpected {opener!r} at {i}")
        while j < len(text) and text[j] in _LITERAL_CHARS:
            j += 1
        state.j = j
        state.end = j if j < len(text) else None
        return
    closers = state.closers
    try:
        while j < len(text):
            c = text[j]
            j += 1
            if state.in_string:
                if state.escaped:
                    state.escaped = False
                elif c == "\\":
                    state.escaped = True
                elif c == '"':
                    state.in_string = False
                    if opener == '"':
                        state.end = j
                        return
                elif c < " ":
                    raise JsonScanError(f"a raw control character inside a string at {j - 1}")
            elif c == '"':
                state.in_string = True
            elif c in "{[":
                closers.append("}" if c == "{" else "]")
            elif c in "}]":
                if not closers or closers.pop() != c:
                    raise JsonScanError(f"unbalanced {c!r} at {j - 1}")
                if not closers:
                    state.end = j
                    return
    finally:
        state.j = j


def scan_object(text: str, i: int, cache: ScanCache | None = None) -> ObjectScan:
    """The members of the object opening at `i` (text[i] == '{'), as far as the text goes and is JSON.

    A value that is not JSON is kept as a member that never ends, so that its span only ever grows. With
    `cache`, the scan resumes after the members it finished last time.
    """
    cache = cache or ScanCache()
    state = cache._objects.get(i)
    if state is None:
        state = cache._objects[i] = _ObjectState()
    if state.result is not None:
        return state.result
    try:
        scan = _scan_members(text, i, state, cache)
    except JsonScanError:
        partial = [] if state.partial is None else [state.partial]
        state.result = ObjectScan((*state.done, *partial), None, broken=True)
        return state.result
    if scan.end is not None:
        state.result = scan
    return scan


def _scan_members(text: str, i: int, state: _ObjectState, cache: ScanCache) -> ObjectScan:
    if state.j is None:
        if text[i] != "{":
            raise JsonScanError(f"expected an object at {i}")
        j = skip_whitespace(text, i + 1)
        if j < len(text) and text[j] == "}":
            return ObjectScan((), j + 1)
        if j >= len(text):
            return ObjectScan((), None)
        state.j = j
    j = skip_whitespace(text, state.j)  # whitespace after the last comma may have arrived since
    while j < len(text):
        if state.partial is None:  # a new member: its key (a member whose value had started resumes there)
            if text[j] != '"':
                raise JsonScanError(f"expected a key at {j}")
            key_end = _string_end(text, j)
            cache.scanned += (len(text) if key_end is None else key_end) - j
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
            state.partial = Member(key, start, None)
        key, start = state.partial.key, state.partial.start
        end = value_end(text, start, cache)
        if end is None:
            break
        state.partial = Member(key, start, end)
        j = skip_whitespace(text, end)
        if j >= len(text):
            break
        if text[j] == "}":
            state.done.append(state.partial)
            state.partial = None
            return ObjectScan(tuple(state.done), j + 1)
        if text[j] != ",":
            raise JsonScanError(f"expected ',' or '}}' at {j}")
        state.done.append(state.partial)
        state.partial = None
        j = skip_whitespace(text, j + 1)
        state.j = j
    partial = [] if state.partial is None else [state.partial]
    return ObjectScan((*state.done, *partial), None)


def scan_object_array(text: str, i: int, cache: ScanCache | None = None) -> list[ObjectScan]:
    """The objects of the array opening at `i` (text[i] == '['), as far as the text goes and is JSON; the last
    may be unfinished or broken. Scanning stops at the first element that is not an object."""
    objects: list[ObjectScan] = []
    j = skip_whitespace(text, i + 1)
    while j < len(text) and text[j] == "{":
        scan = scan_object(text, j, cache)
        objects.append(scan)
        if scan.end is None:
            break
        j = skip_whitespace(text, scan.end)
        if j >= len(text) or text[j] != ",":
            break
        j = skip_whitespace(text, j + 1)
    return objects
