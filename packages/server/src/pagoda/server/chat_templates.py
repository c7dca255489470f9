"""Chat templates: the tokenizer's own, or a built-in Gemma template for tokenizers that ship none."""

from __future__ import annotations

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
