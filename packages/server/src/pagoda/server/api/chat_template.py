"""Render chat messages to a prompt with the tokenizer's chat template, or a built-in Gemma template."""

from __future__ import annotations

from pagoda.server.api.errors import bad_request
from pagoda.server.api.protocol import ChatMessage
from transformers import PreTrainedTokenizerBase

# Gemma's turn format, for the default model when its tokenizer ships no template: system and developer text
# is folded into the next user turn (Gemma has no system role) and the assistant speaks as "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] in ['system', 'developer'] -%}"
    "{%- set ns.system = ns.system + message['content'] | trim + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if role == 'user' -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

_GEMMA_MARKERS = ("<start_of_turn>", "<end_of_turn>")


def resolve_chat_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The template to render chats with: the tokenizer's own, Gemma's for a Gemma vocabulary, else None."""
    own = tokenizer.chat_template
    if isinstance(own, str) and own:
        return own
    vocab = tokenizer.get_vocab()
    if all(marker in vocab for marker in _GEMMA_MARKERS):
        return GEMMA_CHAT_TEMPLATE
    return None


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
