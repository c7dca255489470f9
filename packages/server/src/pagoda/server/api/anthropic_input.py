"""An Anthropic Messages request as the chat request the existing seams serve (system prompt, turns, content
blocks, tools, tool choice, thinking, output format), and a finished chat message as Anthropic content blocks.

The translation is done once, here: the handler then runs the chat path (chat template, tool plan, structured
outputs, reasoning parser, sampling parameters) on its result, so the two APIs cannot drift apart.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pagoda.server.api.anthropic_protocol import (
    CustomTool,
    ImageBlock,
    Message,
    MessagesRequest,
    PromptFields,
    RedactedThinkingBlock,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from pagoda.server.api.errors import bad_request
from pagoda.server.api.protocol import AssistantMessage, ChatCompletionRequest
from pagoda.server.outputs import CompletionOutput
from pydantic import BaseModel, JsonValue, ValidationError
from pydantic_core import from_json

M = TypeVar("M", bound=BaseModel)

IMAGES_IN_TOOL_RESULTS = (
    "an image in a tool result is not served: send it as an image block of the user message"
)
# Block types Anthropic defines that this server does not take (server tools, documents, search results).
UNSERVED_BLOCKS = (
    "document",
    "search_result",
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "container_upload",
    "mcp_tool_use",
    "mcp_tool_result",
    "tool_reference",
)
# The blocks each role may send.
_ROLE_BLOCKS: dict[str, dict[str, type[BaseModel]]] = {
    "user": {"text": TextBlock, "image": ImageBlock, "tool_result": ToolResultBlock},
    "assistant": {
        "text": TextBlock,
        "tool_use": ToolUseBlock,
        "thinking": ThinkingBlock,
        "redacted_thinking": RedactedThinkingBlock,
    },
    "system": {"text": TextBlock},
}
# Fields of a custom tool that are known but not served, with the values that change nothing.
_UNSERVED_TOOL_FIELDS: tuple[tuple[str, tuple[JsonValue, ...]], ...] = (
    ("input_examples", (None, [])),
    ("defer_loading", (None, False)),
    ("allowed_callers", (None, ["direct"])),
    ("eager_input_streaming", (None, True)),  # input is always streamed as the model writes it
)
# Fields of the request that are known but not served, with the values that change nothing.
UNSERVED_REQUEST_FIELDS: tuple[tuple[str, tuple[JsonValue, ...]], ...] = (
    ("speed", (None, "standard")),
    ("container", (None,)),
    ("context_management", (None,)),
    ("mcp_servers", (None, [])),
    ("inference_geo", (None,)),
    ("diagnostics", (None,)),
)
TOOL_RESULT_ERROR_PREFIX = "Error: "  # how a tool_result with is_error reads in the prompt


def new_message_id() -> str:
    """A fresh message id (`msg_` as Anthropic spells them)."""
    return f"msg_{uuid.uuid4().hex}"


def new_tool_use_id() -> str:
    """A fresh tool_use id (`toolu_` as Anthropic spells them)."""
    return f"toolu_{uuid.uuid4().hex}"


def _validate(model: type[M], data: dict[str, JsonValue], where: str, param: str) -> M:
    """`data` as `model`; a 400 naming `where` and the field at fault."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        inner = ".".join(str(part) for part in first["loc"])
        raise bad_request(
            f"{where}.{inner}: {first['msg']}" if inner else f"{where}: {first['msg']}", param
        ) from exc


def _check_unserved(
    value: BaseModel, table: Sequence[tuple[str, tuple[JsonValue, ...]]], where: str, param: str
) -> None:
    """400 for the first known field whose value the server would have to ignore."""
    for name, harmless in table:
        if getattr(value, name) not in harmless:
            raise bad_request(f"{where}{name} is not supported yet", param)


def check_unserved_request(body: PromptFields) -> None:
    """400 naming the first request field Anthropic defines that this server does not serve."""
    for name, harmless in UNSERVED_REQUEST_FIELDS:
        if name in type(body).model_fields and getattr(body, name) not in harmless:
            raise bad_request(f"{name} is not supported yet", name)
    if body.output_config is not None and body.output_config.effort is not None:
        raise bad_request("output_config.effort is not supported yet", "output_config")


def _block(raw: dict[str, JsonValue], where: str, role: str) -> BaseModel:
    """One content block of a `role` message, validated; a 400 naming `where` for a type it may not send."""
    kind = raw.get("type")
    allowed = _ROLE_BLOCKS[role]
    if isinstance(kind, str) and kind in allowed:
        return _validate(allowed[kind], raw, where, "messages")
    known = isinstance(kind, str) and any(kind in blocks for blocks in _ROLE_BLOCKS.values())
    if known or kind in UNSERVED_BLOCKS:
        raise bad_request(f"{where}.type: a {kind!r} block is not served in a {role} message", "messages")
    names = ", ".join(allowed)
    raise bad_request(
        f"{where}.type: {kind!r} is not a content block type ({role} messages take {names})", "messages"
    )


def _blocks(content: str | list[dict[str, JsonValue]], where: str, role: str) -> list[tuple[str, BaseModel]]:
    """A message's content as (position, block) pairs; a string is one text block."""
    if isinstance(content, str):
        return [(where, TextBlock(type="text", text=content))]
    if not content:
        raise bad_request(f"{where}: a message needs at least one content block", "messages")
    return [(f"{where}.{j}", _block(raw, f"{where}.{j}", role)) for j, raw in enumerate(content)]


def system_text(system: str | list[dict[str, JsonValue]], where: str) -> str:
    """The system prompt's text: a string, or its text blocks joined by newlines (as chat joins text parts)."""
    if isinstance(system, str):
        return system
    blocks = _blocks(system, where, "system")
    return "\n".join(block.text for _, block in blocks if isinstance(block, TextBlock))


def _tool_result_text(block: ToolResultBlock, where: str) -> str:
    """The text a tool_result gives the model (text blocks joined by newlines; an error marked as one)."""
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts: list[str] = []
        for k, raw in enumerate(content):
            at = f"{where}.content.{k}"
            kind = raw.get("type")
            if kind == "image":
                raise bad_request(f"{at}.type: {IMAGES_IN_TOOL_RESULTS}", "messages")
            if kind != "text":
                raise bad_request(f"{at}.type: a tool result holds text blocks, not {kind!r}", "messages")
            parts.append(_validate(TextBlock, raw, at, "messages").text)
        text = "\n".join(parts)
    return TOOL_RESULT_ERROR_PREFIX + text if block.is_error else text


def _turns(messages: Sequence[Message]) -> list[tuple[str, list[tuple[str, BaseModel]]]]:
    """The messages as turns: consecutive messages of one role are one turn (as Anthropic combines them)."""
    turns: list[tuple[str, list[tuple[str, BaseModel]]]] = []
    for i, message in enumerate(messages):
        blocks = _blocks(message.content, f"messages.{i}.content", message.role)
        if turns and turns[-1][0] == message.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((message.role, blocks))
    return turns


def chat_messages(body: PromptFields) -> list[dict[str, Any]]:
    """The request's system prompt and turns as chat messages: a tool_use is a call of the assistant message,
    each tool_result a tool message answering it, thinking blocks are left out (chat templates drop past
    reasoning)."""
    if not body.messages:
        raise bad_request("messages must not be empty", "messages")
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        messages.append({"role": "system", "content": system_text(body.system, "system")})
    turns = _turns(body.messages)
    if turns[-1][0] == "assistant":
        raise bad_request(
            f"messages.{len(body.messages) - 1}.role: the last message must be a user message; continuing an "
            "assistant message (prefill) is not supported",
            "messages",
        )
    called: set[str] = set()  # the tool_use ids of the latest assistant turn
    for role, blocks in turns:
        if role == "assistant":
            messages.append(_assistant_message(blocks))
            called = {block.id for _, block in blocks if isinstance(block, ToolUseBlock)}
            continue
        texts: list[str | ImageBlock] = []
        for where, block in blocks:
            if isinstance(block, ToolResultBlock):
                if block.tool_use_id not in called:
                    raise bad_request(
                        f"{where}.tool_use_id: {block.tool_use_id!r} answers no tool_use block of the previous "
                        "assistant message",
                        "messages",
                    )
                if texts:  # text before a result stays before it
                    messages.append({"role": role, "content": _text_content(texts)})
                    texts = []
                content = _tool_result_text(block, where)
                messages.append({"role": "tool", "content": content, "tool_call_id": block.tool_use_id})
            elif isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ImageBlock):
                texts.append(block)
        if texts:
            messages.append({"role": role, "content": _text_content(texts)})
        called = set()
    return messages


def _text_content(texts: Sequence[str | ImageBlock]) -> str | list[dict[str, Any]]:
    """Chat content of some text (and image) blocks: one string, or text parts (the template joins them by
    newlines) and `image_url` parts in their order."""
    if len(texts) == 1 and isinstance(texts[0], str):
        return texts[0]
    return [
        {"type": "text", "text": t}
        if isinstance(t, str)
        else {"type": "image_url", "image_url": {"url": t.url}}
        for t in texts
    ]


def _assistant_message(blocks: list[tuple[str, BaseModel]]) -> dict[str, Any]:
    """An assistant turn as one chat message: its text and its tool calls (thinking left out)."""
    texts = [block.text for _, block in blocks if isinstance(block, TextBlock)]
    calls = [
        {
            "id": block.id,
            "type": "function",
            "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)},
        }
        for _, block in blocks
        if isinstance(block, ToolUseBlock)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": _text_content(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    elif not texts:
        message["content"] = ""  # a turn of thinking only
    return message


def chat_tools(raw: list[dict[str, JsonValue]] | None) -> list[dict[str, Any]] | None:
    """Custom tools as chat's function tools; a 400 on `tools` naming a server tool (none is run here), a
    field not served, an input schema that is not an object schema, or a name given twice."""
    if raw is None:
        return None
    converted: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, data in enumerate(raw):
        kind = data.get("type")
        if kind not in (None, "custom"):
            raise bad_request(
                f"tools.{i}.type: the server tool {kind!r} is not served; only custom tools (name, description, "
                "input_schema) are",
                "tools",
            )
        tool = _validate(CustomTool, data, f"tools.{i}", "tools")
        _check_unserved(tool, _UNSERVED_TOOL_FIELDS, f"tools.{i}.", "tools")
        if tool.input_schema.get("type") != "object":
            raise bad_request(f"tools.{i}.input_schema.type: must be 'object'", "tools")
        if tool.name in names:
            raise bad_request(
                f"tools.{i}.name: {tool.name!r} names two tools; tool names must be unique", "tools"
            )
        names.add(tool.name)
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(body: PromptFields) -> tuple[Any, bool | None]:
    """The chat `tool_choice` and `parallel_tool_calls` of the request's tool_choice."""
    choice = body.tool_choice
    if choice is None:
        return None, None
    if (choice.type == "tool") != (choice.name is not None):
        message = "required with type 'tool'" if choice.name is None else "only with type 'tool'"
        raise bad_request(f"tool_choice.name: {message}", "tool_choice")
    if choice.disable_parallel_tool_use is not None and choice.type == "none":
        raise bad_request("tool_choice.disable_parallel_tool_use: not with type 'none'", "tool_choice")
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def _thinking(body: PromptFields) -> tuple[dict[str, JsonValue] | None, bool]:
    """The template variables and whether thinking blocks are split off, for the request's `thinking`."""
    thinking = body.thinking
    if thinking is None:
        return None, True
    if thinking.display is not None:
        raise bad_request(
            "thinking.display is not supported yet: thinking blocks carry the whole text", "thinking"
        )
    if thinking.type == "enabled":
        raise bad_request(
            'thinking.budget_tokens: a thinking budget is not enforced by this server; send {"type": "adaptive"} '
            '(the model thinks as it was trained to) or {"type": "disabled"}',
            "thinking",
        )
    if thinking.budget_tokens is not None:
        raise bad_request("thinking.budget_tokens: only with type 'enabled'", "thinking")
    if thinking.type == "between_tools":
        raise bad_request("thinking.type: 'between_tools' is not supported yet", "thinking")
    if thinking.type == "disabled":  # Qwen3's and others' switch, as vLLM's chat_template_kwargs pass it
        return {"enable_thinking": False}, False
    return None, True


@dataclass(frozen=True, slots=True)
class Translated:
    """A request as a chat request, and whether its output's thinking is split off into thinking blocks."""

    chat: ChatCompletionRequest
    split_thinking: bool


def translate(body: PromptFields) -> Translated:
    """The chat request serving `body` (the system prompt its first message); a 400 naming the Anthropic field."""
    template_kwargs, split_thinking = _thinking(body)
    tool_choice, parallel = _tool_choice(body)
    fields: dict[str, Any] = {
        "messages": chat_messages(body),
        "tools": chat_tools(body.tools),
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": template_kwargs,
    }
    fmt = None if body.output_config is None else body.output_config.format
    if fmt is not None:
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt.json_schema},
        }
    if isinstance(body, MessagesRequest):
        fields |= {
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "seed": body.seed,
            "min_p": body.min_p,
            "repetition_penalty": body.repetition_penalty,
            "ignore_eos": body.ignore_eos or None,
            "priority": body.priority or None,
        }
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except (
        ValidationError
    ) as exc:  # a message the blocks made that chat cannot take (a bug, not the client's)
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise bad_request(f"messages: {where}: {first['msg']}", "messages") from exc
    return Translated(chat, split_thinking)


def tool_input(arguments: str) -> dict[str, JsonValue]:
    """A call's arguments as a tool_use `input`: the JSON object, or as much of it as was written when the call
    was cut short (parsed as the official clients parse streamed input_json_delta fragments)."""
    try:
        value = from_json(arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def thinking_block(text: str) -> dict[str, JsonValue]:
    """A `thinking` block (no signature: nothing here verifies one)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def text_block(text: str) -> dict[str, JsonValue]:
    """A `text` block."""
    return {"type": "text", "text": text}


def tool_use_block(block_id: str, name: str, tool_input_value: dict[str, JsonValue]) -> dict[str, JsonValue]:
    """A `tool_use` block."""
    return {"type": "tool_use", "id": block_id, "name": name, "input": tool_input_value}


def content_blocks(message: AssistantMessage) -> list[dict[str, JsonValue]]:
    """A finished message's content: its thinking, its text, then its tool uses."""
    blocks: list[dict[str, JsonValue]] = []
    if message.reasoning_content:
        blocks.append(thinking_block(message.reasoning_content))
    if message.content:
        blocks.append(text_block(message.content))
    for call in message.tool_calls:
        blocks.append(
            tool_use_block(new_tool_use_id(), call.function.name, tool_input(call.function.arguments))
        )
    return blocks


def stop_reason(output: CompletionOutput, *, called: bool) -> tuple[StopReason, str | None]:
    """Anthropic's stop reason of a finished output (and the stop sequence that ended it)."""
    if output.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(output.stop_reason, str):
        return "stop_sequence", output.stop_reason
    return "end_turn", None
