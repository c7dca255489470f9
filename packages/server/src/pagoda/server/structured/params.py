"""`StructuredOutputsParams`: what a request's output must match (vLLM's names), and its grammar check."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # xgrammar takes ~0.4 s to import: loaded at the first constrained request, not at start
    import xgrammar as xgr


GrammarKind = Literal["json", "regex", "choice", "grammar", "json_object"]


class GrammarError(ValueError):
    """A schema, regex, choice list or grammar that cannot be compiled; `kind` names the offending field."""

    def __init__(self, kind: GrammarKind | None, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one constraint: a JSON schema, a regex, a choice of strings, an EBNF/GBNF grammar, or any JSON.

    `json` may be given as a dict or as JSON text; it is kept as canonical JSON text (sorted keys), the key
    under which its compiled grammar is cached.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None  # kept as a tuple (one sequence type, so msgspec can decode it)
    grammar: str | None = None
    json_object: bool = False
    # vLLM's option: a `json` schema's output has no whitespace runs outside strings (one space after `,` and
    # `:`), so that output cut short by max_tokens is still a JSON prefix a client can parse.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        """Canonicalize `json` and `choice`; GrammarError unless exactly one constraint is set."""
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [
            self.json is not None,
            self.regex is not None,
            self.choice is not None,
            self.grammar is not None,
        ]
        if sum(given) + self.json_object != 1:
            raise GrammarError(
                None, "structured outputs take exactly one of json, regex, choice, grammar or json_object"
            )

    @property
    def kind(self) -> GrammarKind:
        """Which constraint this is."""
        if self.json is not None:
            return "json"
        if self.regex is not None:
            return "regex"
        if self.choice is not None:
            return "choice"
        if self.grammar is not None:
            return "grammar"
        return "json_object"

    def source(self) -> tuple[GrammarKind, str]:
        """The constraint as (kind, text): the cache key of its compiled grammar (choices become EBNF)."""
        kind = self.kind
        if kind == "choice":
            return kind, choice_grammar(tuple(self.choice or ()))
        text = {"json": self.json, "regex": self.regex, "grammar": self.grammar}.get(kind)
        return kind, text if isinstance(text, str) else ""


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string escapes are EBNF's too)."""
    if not choices:
        raise GrammarError("choice", "choice must list at least one string")
    if not all(choices):
        raise GrammarError("choice", "choice strings must not be empty")
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def parse_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """Parse the constraint without compiling it against a vocabulary (well under a millisecond for usual
    schemas); GrammarError naming the field when it is invalid."""
    import xgrammar as xgr  # at the first constraint, not at start (see the imports)

    kind, text = params.source()
    try:
        if kind == "json":
            schema = json.loads(text)
            if not isinstance(schema, dict | bool):
                raise GrammarError(kind, "a JSON schema must be an object")
            return xgr.Grammar.from_ebnf(json_schema_grammar(text, compact=params.disable_any_whitespace))
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind in ("choice", "grammar"):
            return xgr.Grammar.from_ebnf(text)
        return xgr.Grammar.builtin_json_grammar()
    except (RuntimeError, ValueError) as exc:
        if isinstance(exc, GrammarError):
            raise
        raise GrammarError(kind, f"invalid {_NAMES[kind]}: {_reason(exc)}") from exc


def json_schema_grammar(schema: str, *, compact: bool = False) -> str:
    """The EBNF grammar of a JSON schema (`compact`: no whitespace runs outside strings).

    xgrammar 0.2 lets a length-bounded string (maxLength) hold raw control characters, which JSON forbids (and
    pydantic rejects): its character class is narrowed to the one its unbounded strings already use.
    """
    import xgrammar as xgr  # at the first constraint, not at start (see the imports)

    grammar = str(xgr.Grammar.from_json_schema(schema, **(COMPACT_JSON_OPTIONS if compact else JSON_OPTIONS)))
    return grammar.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"

# Whitespace inside JSON is free (as vLLM's default) but bounded per run: a model that keeps emitting spaces
# would otherwise never close its object.
JSON_OPTIONS: dict[str, Any] = {"any_whitespace": True, "max_whitespace_cnt": 16, "strict_mode": True}
# disable_any_whitespace: xgrammar's fixed separators, ", " and ": ", and no other whitespace outside strings.
COMPACT_JSON_OPTIONS: dict[str, Any] = {"any_whitespace": False, "strict_mode": True}

_NAMES: dict[GrammarKind, str] = {
    "json": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "EBNF grammar",
    "json_object": "JSON grammar",
}


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    message = str(exc).strip()
    _, sep, rest = message.partition(": ")
    return rest if sep and message.startswith("[") else message
