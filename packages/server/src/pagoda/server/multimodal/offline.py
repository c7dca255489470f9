"""Images of the offline API (`LLM.generate`'s vLLM dict prompts, `LLM.chat`'s image parts) as a processed prompt.

`LLM.generate({"prompt": "... <marker> ...", "multi_modal_data": {"image": img_or_list}})` takes PIL images or
image URLs; `LLM.chat` takes `image_url` parts (a URL, or `{"url": ...}`) and vLLM's `image_pil` parts. The same
media policy as the server's: data URLs and PIL images always, file:// only under allowed_local_media_path,
http(s) only from allowed_media_domains. Refusals are MediaError (a ValueError) naming the argument. vLLM's
tokens dict prompt, `{"prompt_token_ids": [...]}`, is read here too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagoda.server.multimodal.inputs import ProcessedPrompt
from pagoda.server.multimodal.media import MediaError, MediaPolicy, image_from_object
from pagoda.server.multimodal.processor import MultiModalProcessor
from PIL import Image


def _as_list(value: object) -> list[object]:
    """One image or a list of them, as a list."""
    return list(value) if isinstance(value, list | tuple) else [value]


def dict_prompt_tokens(prompt: Mapping[str, Any], index: int) -> list[int] | None:
    """The token ids of vLLM's tokens dict prompt (`{"prompt_token_ids": [...]}`), None for a text dict prompt;
    MediaError naming the field when the ids are not a list of ints or another key comes with them (ids outside the
    vocabulary are the engine's to refuse, as for every prompt form)."""
    if "prompt_token_ids" not in prompt:
        return None
    where = f"prompts[{index}]"
    ids = prompt["prompt_token_ids"]
    if not isinstance(ids, list | tuple) or not all(isinstance(t, int) for t in ids):
        raise MediaError(f"{where}.prompt_token_ids: a list of token ids", f"{where}.prompt_token_ids")
    unknown = sorted(set(prompt) - {"prompt_token_ids"})
    if unknown:
        raise MediaError(f"{where}: unknown key {unknown[0]!r} beside prompt_token_ids", where)
    return list(ids)


def dict_prompt_images(prompt: Mapping[str, Any], index: int) -> tuple[str, list[tuple[object, str]]]:
    """The text and (image, argument name) pairs of a vLLM dict prompt; MediaError naming an unknown key."""
    where = f"prompts[{index}]"
    text = prompt.get("prompt")
    if not isinstance(text, str):
        raise MediaError(f"{where}: a dict prompt needs a text 'prompt'", f"{where}.prompt")
    unknown = sorted(set(prompt) - {"prompt", "multi_modal_data"})
    if unknown:
        raise MediaError(f"{where}: unknown key {unknown[0]!r} (prompt, multi_modal_data)", where)
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, Mapping) or set(data) - {"image"}:
        raise MediaError(
            f"{where}.multi_modal_data: only {{'image': ...}} is served", f"{where}.multi_modal_data"
        )
    images = [] if data.get("image") is None else _as_list(data["image"])
    return text, [(image, f"{where}.multi_modal_data.image[{j}]") for j, image in enumerate(images)]


def chat_images(
    conversation: Sequence[Mapping[str, Any]], index: int
) -> tuple[list[dict[str, Any]], list[tuple[object, str]]]:
    """The conversation with every image part as the template's `{"type": "image"}`, and the (image, argument
    name) pairs in order; messages without an image part pass through unchanged."""
    messages: list[dict[str, Any]] = []
    images: list[tuple[object, str]] = []
    for i, message in enumerate(conversation):
        content = message.get("content")
        parts = content if isinstance(content, list) else []
        if not any(isinstance(p, Mapping) and p.get("type") in ("image_url", "image_pil") for p in parts):
            messages.append(dict(message))
            continue
        rendered: list[dict[str, Any]] = []
        for j, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, Mapping) else None
            name = f"messages[{index}][{i}].content[{j}]"
            if kind == "image_url":
                url = part["image_url"]
                images.append((url.get("url") if isinstance(url, Mapping) else url, name))
                rendered.append({"type": "image"})
            elif kind == "image_pil":
                images.append((part.get("image_pil"), name))
                rendered.append({"type": "image"})
            else:
                rendered.append(
                    dict(part) if isinstance(part, Mapping) else {"type": "text", "text": str(part)}
                )
        messages.append({**message, "content": rendered})
    return messages, images


def check_marker(text: str, processor: MultiModalProcessor | None, name: str) -> None:
    """MediaError when a prompt without images holds the model's image marker as text."""
    if processor is not None and processor.image_marker in text:
        raise MediaError(
            f"{name} holds the model's image marker {processor.image_marker!r} but no image; pass images in "
            "multi_modal_data (or as image parts)",
            name,
        )


def process_images(
    text: str,
    images: Sequence[tuple[object, str]],
    processor: MultiModalProcessor | None,
    policy: MediaPolicy,
    *,
    add_special_tokens: bool = True,  # False for a rendered chat template, which writes BOS itself
) -> ProcessedPrompt:
    """The processed prompt of a text and its images, loaded under `policy`; MediaError naming the argument of a
    refused image, or the first image when the model takes none."""
    if processor is None:
        raise MediaError("the model does not take images (it is a text-only model)", images[0][1])
    policy.check_count([name for _, name in images])
    loaded: list[Image.Image] = [image_from_object(image, policy, name) for image, name in images]
    return processor.process(text, loaded, add_special_tokens=add_special_tokens)
