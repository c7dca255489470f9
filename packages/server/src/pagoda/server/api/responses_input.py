"""A /v1/responses body as the chat request the existing seams serve: input items as chat messages, function
tools as chat tools, `text.format` as `response_format`; and a response's output items, built from the chat
handler's parsed message."""

from __future__ import annotations

import uuid
from typing import Any

from pagoda.server.api.errors import bad_request
from pagoda.server.api.protocol import AssistantMessage, ChatCompletionRequest
from pagoda.server.api.responses_protocol import (
    BUILT_IN_TOOLS,
    INPUT_ITEM_TYPES,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputImage,
    InputItem,
    InputText,
    MessageItem,
    NamedFunctionChoice,
    OutputText,
    ResponsesRequest,
)
from pydantic import JsonValue, ValidationError


def new_item_id(prefix: str) -> str:
    """A fresh output item id (`msg_`, `fc_`, `rs_` as OpenAI spells them)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(raw: list[dict[str, JsonValue]]) -> list[InputItem]:
    """The input items, each validated as the model its `type` names; a 400 on `input` naming the item."""
    items: list[InputItem] = []
    for i, data in enumerate(raw):
        kind = data.get("type", "message")
        model = INPUT_ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            known = ", ".join(INPUT_ITEM_TYPES)
            raise bad_request(f"input.{i}.type: {kind!r} is not an input item type ({known})", "input")
        try:
            items.append(model.model_validate(data))
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(part) for part in first["loc"])
            raise bad_request(f"input.{i}.{where}: {first['msg']}", "input") from exc
    return items


def _chat_part(part: InputText | InputImage | OutputText) -> dict[str, Any]:
    """A message item's content part as chat's: text, or an image_url part; a 400 on `input` for an image given
    by file_id (there is no file store)."""
    if isinstance(part, InputImage):
        if part.image_url is None:
            raise bad_request("input_image needs image_url (a data: URL); file_id is not served", "input")
        return {"type": "image_url", "image_url": {"url": part.image_url}}
    return {"type": "text", "text": part.text}


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages (instructions left out): consecutive function calls become one
    assistant message with several tool calls, a call's output a tool message, reasoning items are dropped."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for item in input_items(body.input):
        if isinstance(item, MessageItem):
            content: Any = item.content
            if not isinstance(content, str):
                content = [_chat_part(part) for part in content]
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
    return messages


def chat_tools(tools: list[dict[str, JsonValue]] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's nested form; a 400 on `tools` naming a built-in tool (none is run here)."""
    if tools is None:
        return None
    converted: list[dict[str, Any]] = []
    for i, raw in enumerate(tools):
        kind = raw.get("type")
        if kind != "function":
            what = "built-in tool" if kind in BUILT_IN_TOOLS else "tool type"
            raise bad_request(
                f"tools.{i}.type: the {what} {kind!r} is not supported; only function tools are served",
                "tools",
            )
        try:
            tool = FunctionTool.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(part) for part in first["loc"])
            raise bad_request(f"tools.{i}.{where}: {first['msg']}", "tools") from exc
        function = tool.model_dump(exclude={"type"}, exclude_none=True)
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if isinstance(choice, NamedFunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = None if body.text is None else body.text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise bad_request("text.format of type json_schema needs a schema", "text")
    schema: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.json_schema}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}


def chat_request(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request serving `body` over `conversation` (the earlier turns and this input, without the
    instructions, which lead as a system message and are not carried to the next turn, as OpenAI does)."""
    messages = list(conversation)
    if body.instructions is not None:
        messages.insert(0, {"role": "system", "content": body.instructions})
    fields: dict[str, Any] = {
        "model": body.model,  # a LoRA adapter's name picks the adapter (ctx.sampling_params reads it)
        "messages": messages,
        "tools": chat_tools(body.tools),
        "tool_choice": _tool_choice(body),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "ignore_eos": body.ignore_eos,
        "priority": body.priority,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:  # a message the items made that chat cannot take (a bug, not the client's)
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise bad_request(f"input: {where}: {first['msg']}", "input") from exc


def output_items(message: AssistantMessage) -> list[dict[str, Any]]:
    """A finished response's output items: its reasoning, its message, then its function calls."""
    items: list[dict[str, Any]] = []
    if message.reasoning_content:
        items.append(reasoning_item(new_item_id("rs"), message.reasoning_content))
    if message.content:
        items.append(message_item(new_item_id("msg"), message.content, "completed"))
    for call in message.tool_calls:
        items.append(
            function_call_item(new_item_id("fc"), call.id, call.function.name, call.function.arguments)
        )
    return items


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A `reasoning` output item holding the think block's text."""
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant `message` output item (no content part yet when `text` is None)."""
    content = [] if text is None else [output_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text_part(text: str) -> dict[str, Any]:
    """An `output_text` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    """A `function_call` output item."""
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a `previous_response_id` continues from (reasoning dropped)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in items
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]
