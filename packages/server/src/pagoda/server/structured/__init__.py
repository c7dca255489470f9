"""Structured outputs on xgrammar: constraints, background compilation and the per-step token bitmask (the
engine's admission gate of requests whose grammar is compiling is `pagoda.server.engine.grammar_gate`)."""

from pagoda.server.structured.bitmask import FilledBitmask, GrammarBitmask
from pagoda.server.structured.manager import StructuredOutputManager
from pagoda.server.structured.params import GrammarError, GrammarKind, StructuredOutputsParams, parse_grammar

__all__ = [
    "FilledBitmask",
    "GrammarBitmask",
    "GrammarError",
    "GrammarKind",
    "StructuredOutputManager",
    "StructuredOutputsParams",
    "parse_grammar",
]
