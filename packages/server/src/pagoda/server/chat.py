"""Chat templates and rendering, one set of rules for both front doors (`LLM.chat` and the chat endpoints)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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

Message = Mapping[str, str]  # {"role": ..., "content": ...}


class ChatTemplateError(ValueError):
    """A conversation that cannot be rendered: empty, no template, or rejected by the template."""


def resolve_chat_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The template to render chats with: the tokenizer's own, Gemma's for a Gemma vocabulary, else None."""
    own = tokenizer.chat_template
    if isinstance(own, str) and own:
        return own
    vocab = tokenizer.get_vocab()
    if all(marker in vocab for marker in _GEMMA_MARKERS):
        return GEMMA_CHAT_TEMPLATE
    return None


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of a conversation (tokenize it without adding special tokens: the template wrote them)."""
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    if template is None:
        raise ChatTemplateError(
            "this model's tokenizer has no chat template; send a plain prompt (generate() or /v1/completions)"
        )
    try:
        rendered = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except Exception as exc:  # the template's own checks (role order, ...) raise jinja2 errors
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc
    if not isinstance(rendered, str):
        raise ChatTemplateError("the chat template did not render to text")
    return rendered
