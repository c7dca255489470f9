"""Chat templates and rendering, one set of rules for both front doors (`LLM.chat` and the chat endpoints)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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

Message = Mapping[str, Any]  # {"role": ..., "content": ...}, and tool_calls / tool_call_id


class ChatTemplateError(ValueError):
    """A conversation that cannot be rendered: empty, no template, or rejected by the template."""


def resolve_chat_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The template to render chats with: the tokenizer's own, Gemma's for a Gemma vocabulary, else None."""
    own = tokenizer.chat_template
    if isinstance(own, str) and own:
        return own
    if all(_has_token(tokenizer, marker) for marker in _GEMMA_MARKERS):
        return GEMMA_CHAT_TEMPLATE
    return None


def _has_token(tokenizer: PreTrainedTokenizerBase, token: str) -> bool:
    """Whether `token` is one token of the vocabulary (looked up, not by building the whole vocabulary: that
    took 0.4 s of every start for Gemma 3's 262k tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.token_to_id(token) is not None
    return token in tokenizer.get_vocab()


def load_chat_template(value: str) -> str:
    """vLLM's `--chat-template`: the text of the file at `value`, or `value` itself when it reads as a template.

    A value that is not a file and has none of `{`, `}` or a newline is most likely a mistyped path: a
    ValueError says so rather than rendering every chat as that literal string.
    """
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template: {value!r} is not a file, and does not look like a Jinja template")


def check_template_kwargs(tokenizer: PreTrainedTokenizerBase, kwargs: Mapping[str, Any]) -> None:
    """ValueError naming the first key of `chat_template_kwargs` that is one of apply_chat_template's own
    parameters (`tokenize`, `messages`, ...): the request may add template variables, not change the call."""
    own = inspect.signature(tokenizer.apply_chat_template).parameters
    for key in kwargs:
        if key in own:
            raise ValueError(
                f"chat_template_kwargs: {key!r} is a parameter of the renderer, not a template variable"
            )


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text of a conversation (tokenize it without adding special tokens: the template wrote them).

    `template_kwargs` become variables of the template (`enable_thinking`); check them first with
    `check_template_kwargs`. `tools` (OpenAI's function definitions) go to the template's `tools` variable.
    """
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
            tools=None if tools is None else [dict(t) for t in tools],
            **(template_kwargs or {}),
        )
    except Exception as exc:  # the template's own checks (role order, ...) raise jinja2 errors
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc
    if not isinstance(rendered, str):
        raise ChatTemplateError("the chat template did not render to text")
    return rendered
