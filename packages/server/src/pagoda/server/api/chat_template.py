"""Render chat messages to a prompt with the tokenizer's chat template, or a built-in Gemma template."""

from __future__ import annotations

from pagoda.server.api.errors import bad_request
from pagoda.server.api.protocol import ChatMessage
from transformers import PreTrainedTokenizerBase


def message_text(message: ChatMessage) -> str:
    """A message's content as one string (text parts joined by newlines)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(part.text for part in message.content)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of a conversation; a 400 error when it is empty or the template rejects it."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if template is None:
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
    conversation = [{"role": m.role, "content": message_text(m)} for m in messages]
    try:
        rendered = tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except Exception as exc:  # the template's own checks (role order, ...) raise jinja2 errors
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    if not isinstance(rendered, str):
        raise bad_request("the chat template did not render to text", "messages")
    return rendered
