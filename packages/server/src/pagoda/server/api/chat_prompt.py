"""Chat messages -> the engine's prompt: rendered with the chat template, then tokenized, or, with image parts,
their images loaded and the prompt expanded by the model's multimodal processor.

A message with image parts reaches the template in Hugging Face's content-list form (`{"type": "image"}` for
each image, `{"type": "text", "text": ...}` for each text part), so the model folder's template writes its own
image marker; a message without one keeps its joined text, so text-only prompts render as they always did.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.server.api.errors import bad_request
from pagoda.server.api.protocol import ChatMessage, ImageContentPart
from pagoda.server.api.serving_base import ServingContext
from pagoda.server.api.serving_tools import template_tool_fields
from pagoda.server.chat import ChatTemplateError, check_template_kwargs, render_chat
from pagoda.server.multimodal import MultiModalInputs
from pagoda.server.multimodal.media import MediaError, load_images_async
from pydantic import JsonValue

# The request field of image part j of message i (chat: `messages[0].content[1].image_url`).
ImageParam = Callable[[int, int], str]


def chat_image_param(message: int, part: int) -> str:
    """The chat field of an image part."""
    return f"messages[{message}].content[{part}].image_url"


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image part of a conversation: its URL and the request field it came in."""

    url: str
    param: str


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation ready for the engine: its text, its token ids (image placeholders included) and images."""

    text: str
    token_ids: list[int]
    multi_modal: MultiModalInputs | None = None


def message_text(message: ChatMessage) -> str:
    """A message's content as one string (text parts joined by newlines; image parts left out)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(part.text for part in message.content if not isinstance(part, ImageContentPart))


def conversation_of(
    messages: Sequence[ChatMessage], image_param: ImageParam = chat_image_param
) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """The template's messages and the conversation's image parts in order; a 400 naming an image part of a
    message that is not the user's."""
    conversation: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    for i, m in enumerate(messages):
        content: Any = message_text(m)
        if isinstance(m.content, list) and any(isinstance(p, ImageContentPart) for p in m.content):
            content = []
            for j, part in enumerate(m.content):
                if isinstance(part, ImageContentPart):
                    if m.role != "user":
                        raise bad_request(
                            f"image parts are taken in user messages only, not {m.role}", image_param(i, j)
                        )
                    images.append(ImageRef(part.url, image_param(i, j)))
                    content.append({"type": "image"})
                else:
                    content.append({"type": "text", "text": part.text})
        conversation.append({"role": m.role, "content": content, **template_tool_fields(m)})
    return conversation, images


async def render_conversation(
    ctx: ServingContext,
    conversation: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, JsonValue] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of a conversation (rendered off the event loop); a 400 on `messages` when it cannot be
    rendered, on `chat_template_kwargs` when a key would change the call rather than the template."""
    if template_kwargs:
        try:
            check_template_kwargs(ctx.tokenizer, template_kwargs)
        except ValueError as exc:
            raise bad_request(str(exc), "chat_template_kwargs") from exc

    def render() -> str:
        return render_chat(
            ctx.tokenizer,
            ctx.chat_template,
            conversation,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
            tools=tools,
        )

    try:
        return await ctx.run(render)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from exc


async def render_messages(
    ctx: ServingContext,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, JsonValue] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of a request's messages and tools (see `render_conversation`)."""
    conversation, _ = conversation_of(messages)
    return await render_conversation(
        ctx,
        conversation,
        add_generation_prompt=add_generation_prompt,
        template_kwargs=template_kwargs,
        tools=tools,
    )


def _check_marker_text(
    messages: Sequence[ChatMessage], marker: str, param: str, image_param: ImageParam
) -> None:
    """A 400 naming the message whose text holds the model's image marker: it would stand for an image that is
    not there (or displace one that is)."""
    for i, m in enumerate(messages):
        texts: list[tuple[int | None, str]] = []
        if isinstance(m.content, str):
            texts.append((None, m.content))
        elif m.content is not None:
            texts += [(j, p.text) for j, p in enumerate(m.content) if not isinstance(p, ImageContentPart)]
        for j, text in texts:
            if marker in text:
                where = f"messages[{i}].content" if j is None else f"messages[{i}].content[{j}].text"
                named = where if image_param is chat_image_param else param
                raise bad_request(
                    f"{where} holds the model's image marker {marker!r} as text; send images as image parts",
                    named,
                )


async def chat_prompt(
    ctx: ServingContext,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, JsonValue] | None = None,
    tools: list[dict[str, Any]] | None = None,
    param: str = "messages",
    image_param: ImageParam = chat_image_param,
) -> ChatPrompt:
    """The engine prompt of a conversation: rendered, then tokenized, or with image parts, its images loaded
    (concurrently, under the media policy) and the prompt expanded by the model's processor (off the event
    loop). 400s name the field: `param` for the prompt as a whole, `image_param` for an image part."""
    conversation, images = conversation_of(messages, image_param)
    front = ctx.images
    processor = front.processor
    if images and processor is None:
        raise bad_request("the model does not take images (it is a text-only model)", images[0].param)
    if processor is not None:
        _check_marker_text(messages, processor.image_marker, param, image_param)
    try:
        front.policy.check_count([image.param for image in images])
    except MediaError as exc:
        raise bad_request(str(exc), exc.param) from exc
    text = await render_conversation(
        ctx,
        conversation,
        add_generation_prompt=add_generation_prompt,
        template_kwargs=template_kwargs,
        tools=tools,
    )
    ctx.check_prompt_chars(text, param)
    if not images or processor is None:
        # The template writes the special tokens (BOS) itself.
        (token_ids,) = await ctx.encode([text], add_special_tokens=False)
        return ChatPrompt(text, token_ids)
    try:
        loaded = await load_images_async([(image.url, image.param) for image in images], front.policy)
    except MediaError as exc:
        raise bad_request(str(exc), exc.param) from exc
    try:
        # The template writes the special tokens (BOS) itself, as for text.
        processed = await ctx.run(lambda: processor.process(text, loaded, add_special_tokens=False))
    except ValueError as exc:  # its markers and the images disagree in number (a template that wrote none)
        raise bad_request(f"the prompt's images cannot be placed: {exc}", param) from exc
    return ChatPrompt(text, list(processed.token_ids), processed.multi_modal)
