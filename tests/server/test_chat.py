"""chat.py: which template renders a conversation, and the errors both front doors share."""

from __future__ import annotations

import pytest
from api_fake_engine import make_char_tokenizer
from pagoda.server.chat import (
    GEMMA_CHAT_TEMPLATE,
    ChatTemplateError,
    check_template_kwargs,
    render_chat,
    resolve_chat_template,
)

HELLO = [{"role": "user", "content": "hi"}]


def test_the_tokenizers_own_template_wins_over_gemmas() -> None:
    """A tokenizer's own template is used; a Gemma vocabulary without one gets the built-in Gemma template."""
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert resolve_chat_template(make_char_tokenizer(chat_template=own)) == own
    assert resolve_chat_template(make_char_tokenizer()) == GEMMA_CHAT_TEMPLATE


def test_render_chat_writes_the_generation_prompt() -> None:
    """The Gemma template folds the system turn into the user turn and opens the model's turn."""
    tokenizer = make_char_tokenizer()
    messages = [{"role": "system", "content": "be brief"}, *HELLO]
    text = render_chat(tokenizer, GEMMA_CHAT_TEMPLATE, messages)
    assert text == "<bos><start_of_turn>user\nbe brief\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    closed = render_chat(tokenizer, GEMMA_CHAT_TEMPLATE, messages, add_generation_prompt=False)
    assert closed == text.removesuffix("<start_of_turn>model\n")


@pytest.mark.parametrize(
    ("template", "messages", "message"),
    [
        (GEMMA_CHAT_TEMPLATE, [], "must not be empty"),
        (None, HELLO, "no chat template"),
        ("{{ raise_exception('roles must alternate') }}", HELLO, "roles must alternate"),
    ],
)
def test_unrenderable_conversations_raise_chat_template_error(
    template: str | None, messages: list[dict[str, str]], message: str
) -> None:
    """Empty conversations, a missing template and the template's own checks raise one ValueError subclass."""
    with pytest.raises(ChatTemplateError, match=message):
        render_chat(make_char_tokenizer(), template, messages)


def test_template_kwargs_become_template_variables() -> None:
    """`template_kwargs` reach the template; a renderer parameter among them is refused before rendering."""
    template = "{{ messages[0]['content'] }}{% if flag %}+{% endif %}"
    tokenizer = make_char_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(tokenizer, template, messages, template_kwargs={"flag": True}) == "hi+"
    assert render_chat(tokenizer, template, messages, template_kwargs={"flag": False}) == "hi"
    check_template_kwargs(tokenizer, {"flag": True, "enable_thinking": False})
    with pytest.raises(ValueError, match="add_generation_prompt"):
        check_template_kwargs(tokenizer, {"add_generation_prompt": False})
