"""Structured outputs on xgrammar: constraints, background compilation, the admission gate of requests whose
grammar is compiling, and the per-step token bitmask."""

from pagoda.server.structured.bitmask import FilledBitmask, GrammarBitmask
from pagoda.server.structured.gate import GrammarGate
from pagoda.server.structured.manager import StructuredOutputManager
from pagoda.server.structured.params import GrammarError, GrammarKind, StructuredOutputsParams, parse_grammar

__all__ = [
    "FilledBitmask",
    "GrammarBitmask",
    "GrammarError",
    "GrammarGate",
    "GrammarKind",
    "StructuredOutputManager",
    "StructuredOutputsParams",
    "parse_grammar",
]
