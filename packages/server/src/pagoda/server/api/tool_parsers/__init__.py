"""Tool-call parsers (`--tool-call-parser`), the forced `tool_choice` parsers, and the stream of call deltas."""

from pagoda.server.api.tool_parsers.base import (
    ParsedTools,
    ToolCallParser,
    ToolCallStream,
    ToolCallText,
    tool_calls,
)
from pagoda.server.api.tool_parsers.forced import (
    NamedToolCall,
    RequiredToolCalls,
    parameters_schema,
    required_schema,
)
from pagoda.server.api.tool_parsers.hermes import HermesToolParser
from pagoda.server.api.tool_parsers.llama3_json import Llama3JsonToolParser
from pagoda.server.api.tool_parsers.mistral import MistralToolParser
from pagoda.server.config import ToolParserName


def make_tool_parser(name: ToolParserName) -> ToolCallParser:
    """The parser vLLM's `--tool-call-parser NAME` selects."""
    if name == "hermes":
        return HermesToolParser()
    if name == "llama3_json":
        return Llama3JsonToolParser()
    return MistralToolParser()


__all__ = [
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedToolCall",
    "ParsedTools",
    "RequiredToolCalls",
    "ToolCallParser",
    "ToolCallStream",
    "ToolCallText",
    "make_tool_parser",
    "parameters_schema",
    "required_schema",
    "tool_calls",
]
