"""Tool calling on /v1/chat/completions: how a request's `tool_choice` is served (a parser, or a schema enforced by
structured output), the history's messages as chat templates read them, and the calls of a response."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.server.api.errors import bad_request
from pagoda.server.api.protocol import ChatCompletionRequest, ChatMessage, FinishReasonField
from pagoda.server.api.reasoning import ReasoningParser
from pagoda.server.api.serving_structured import requested_constraint
from pagoda.server.api.tool_fields import ChatTool, NamedToolChoice, ToolCall
from pagoda.server.api.tool_parsers import (
    NamedToolCall,
    RequiredToolCalls,
    ToolCallParser,
    ToolCallStream,
    parameters_schema,
    required_schema,
    tool_calls,
)
from pagoda.server.multimodal import MultiModalInputs
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.structured import GrammarError, StructuredOutputsParams, parse_grammar

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request's tools are served."""

    tools: list[dict[str, Any]] | None = None  # what the chat template renders
    parser: ToolCallParser | None = None  # reads the calls back from the output (None: all of it is content)
    constraint: StructuredOutputsParams | None = (
        None  # "required" and named: the schema structured output enforces
    )
    max_calls: int | None = None  # 1 with parallel_tool_calls false
    stop_means_tool_calls: bool = (
        False  # auto and "required" (as vLLM): a stop with calls finishes as "tool_calls"
    )

    def adjust(self, params: SamplingParams) -> SamplingParams:
        """`params` with the enforced schema; under auto, special tokens kept in the text (vLLM's parsers do it:
        `<tool_call>`, `<|python_tag|>` and `[TOOL_CALLS]` are special tokens of their models)."""
        if self.constraint is not None:
            return dataclasses.replace(params, structured_outputs=self.constraint)
        if self.parser is not None:
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def stream(self) -> ToolCallStream | None:
        """A new choice's call stream (None without a parser)."""
        return None if self.parser is None else ToolCallStream(self.parser, self.max_calls)

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished choice's content (None when empty) and calls."""
        if self.parser is None:
            return text, []
        parsed = self.parser.parse(text, final=True)
        return parsed.content or None, tool_calls(parsed.calls[: self.max_calls])

    def finish_reason(self, reason: FinishReasonField, *, called: bool) -> FinishReasonField:
        """The choice's finish reason: "tool_calls" for a stop after calls under auto or "required"."""
        return "tool_calls" if reason == "stop" and called and self.stop_means_tool_calls else reason


def plan_tools(
    body: ChatCompletionRequest, auto_parser: ToolCallParser | None, *, compact_json: bool = False
) -> ToolPlan:
    """How `body` is served (its schemas parsed, so run it off the event loop); a 400 naming the field at fault.

    `compact_json`: the grammar of a required or named choice allows no whitespace runs outside strings.

    As vLLM: without `tool_choice`, tools mean "auto", which needs the server's `--enable-auto-tool-choice
    --tool-call-parser` (`auto_parser`); "none" renders the tools but parses nothing.
    """
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools: set tools, or leave tool_choice out", "tool_choice")
    for i, tool in enumerate(tools):
        try:
            parse_grammar(StructuredOutputsParams(json=parameters_schema(tool)))
        except GrammarError as exc:
            raise bad_request(f"tools.{i}.function.parameters: {exc}", "tools") from exc
    rendered = template_tools(tools)
    max_calls = 1 if body.parallel_tool_calls is False else None
    if choice == "none":
        return ToolPlan(tools=rendered)
    if choice == "auto":
        if auto_parser is None:
            raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolPlan(rendered, auto_parser, max_calls=max_calls, stop_means_tool_calls=True)
    requested = requested_constraint(body)
    if requested is not None:
        field = next(iter(requested[1].values()))
        raise bad_request(f"{field} cannot be combined with a required or named tool_choice", field)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        named = next((t for t in tools if t.function.name == name), None)
        if named is None:
            raise bad_request(f"tool_choice: the function {name!r} is not one of tools", "tool_choice")
        constraint = StructuredOutputsParams(
            json=parameters_schema(named), disable_any_whitespace=compact_json
        )
        return ToolPlan(rendered, NamedToolCall(name), constraint)
    try:
        schema = required_schema(tools, parallel=max_calls is None)
        parse_grammar(StructuredOutputsParams(json=schema))
    except ValueError as exc:  # each tool parsed alone, but their $defs may clash once lifted together
        raise bad_request(str(exc), "tools") from exc
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=compact_json)
    return ToolPlan(rendered, RequiredToolCalls(), constraint, max_calls, True)


def template_tools(tools: Sequence[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template's `tools` variable reads them (None when there are none)."""
    return [tool.model_dump(exclude_none=True) for tool in tools or ()] or None


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """400 on `messages` for tool calls outside assistant messages, or a tool message without tool_call_id."""
    for i, message in enumerate(messages):
        if message.tool_calls is not None and message.role != "assistant":
            raise bad_request(f"messages.{i}.tool_calls: only assistant messages make tool calls", "messages")
        if message.role == "tool" and message.tool_call_id is None:
            raise bad_request(
                f"messages.{i}.tool_call_id: a tool message answers a call; name it", "messages"
            )
        if message.tool_call_id is not None and message.role != "tool":
            raise bad_request(f"messages.{i}.tool_call_id: only tool messages answer calls", "messages")


def template_tool_fields(message: ChatMessage) -> dict[str, Any]:
    """A message's tool fields as chat templates read them: `tool_call_id`, and `tool_calls` whose arguments
    are a dict when they are a JSON object (transformers' convention, as vLLM passes them), else the text."""
    fields: dict[str, Any] = {}
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments: Any = json.loads(call.function.arguments)
            except ValueError:
                arguments = call.function.arguments
            if not isinstance(arguments, dict):
                arguments = call.function.arguments
            function = {"name": call.function.name, "arguments": arguments}
            calls.append({"id": call.id, "type": call.type, "function": function})
        fields["tool_calls"] = calls
    return fields


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat-shaped request ready for the engine (Responses, Anthropic Messages): its prompt, sampling parameters,
    tool plan and the reasoning parser that splits its output (None: nothing is split off)."""

    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    plan: ToolPlan
    reasoning: ReasoningParser | None
    multi_modal: MultiModalInputs | None = None  # the prompt's images
