"""A vision-language model behind `pagoda serve`, driven by the official openai client as users do: an image as a
data URL gives transformers' greedy text, usage counts its tokens and reports the prefix-cache hit of a repeated
image, the Responses API takes `input_image`, and a bad image is a 400 naming the part while the server keeps
serving."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import openai
import pytest
import torch
from pagoda.server.multimodal.registry import processor_for
from pagoda.server.testing.serve import LiveServer
from pagoda.server.testing.tiny_qwen_vl import make_tiny_qwen_vl
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

MAX_TOKENS = 6


def data_url(seed: int) -> tuple[str, Image.Image]:
    """A random 112x84 PNG as a data URL, and the picture."""
    image = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (84, 112, 3), dtype=np.uint8), "RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode(), image


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2-VL."""
    return make_tiny_qwen_vl("qwen2_vl", tmp_path_factory.mktemp("vlm-live") / "qwen2_vl")


@pytest.fixture(scope="module")
def client(folder: Path) -> Iterator[openai.OpenAI]:
    """The openai client of a live server on the tiny VLM (float32, 4-token blocks), its engine in an engine-core
    process: the images cross the front end's wire to it."""
    flags = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "4", "--engine-core", "process"]
    server = LiveServer(folder, flags)
    try:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    finally:
        server.stop()


def reference_tokens(folder: Path, parts: list[str | Image.Image]) -> tuple[list[int], int]:
    """transformers' greedy tokens for one user turn, and the prompt's token count."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = processor_for(folder, AutoConfig.from_pretrained(folder))
    assert processor is not None
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
    messages: Any = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)
    images = [p for p in parts if isinstance(p, Image.Image)]
    prompt = processor.process(text, images, add_special_tokens=False)  # the template writes BOS itself
    model = cast(Any, AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)).eval()
    ids = torch.tensor([prompt.token_ids])
    item = prompt.multi_modal.images[0]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            pixel_values=item.tensors["pixel_values"],
            image_grid_thw=item.tensors["image_grid_thw"],
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=[],
            pad_token_id=0,
        )
    return cast(list[int], out[0, ids.shape[1] :].tolist()), len(prompt.token_ids)


def token_ids(completion: Any) -> list[int]:
    """The sampled token ids of a chat completion asked with logprobs and return_tokens_as_token_ids."""
    return [int(entry.token.removeprefix("token_id:")) for entry in completion.choices[0].logprobs.content]


def test_an_image_gives_transformers_text_and_a_repeat_hits_the_cache(
    client: openai.OpenAI, folder: Path
) -> None:
    """Chat completions with an image part: transformers' greedy tokens; usage counts the image tokens; the same
    request again reports cached prompt tokens past the image."""
    url, image = data_url(0)
    messages: Any = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe"},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "please."},
            ],
        }
    ]
    want, prompt_len = reference_tokens(folder, ["Describe", image, "please."])
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    model = client.models.list().data[0].id
    first = client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, extra_body=extra
    )
    assert token_ids(first) == want
    assert first.usage is not None and first.usage.prompt_tokens == prompt_len
    again = client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, extra_body=extra
    )
    assert token_ids(again) == want
    details = again.usage.prompt_tokens_details if again.usage else None
    assert (
        details is not None and details.cached_tokens is not None and details.cached_tokens >= prompt_len - 8
    )


def test_responses_take_input_image(client: openai.OpenAI) -> None:
    """The Responses API's input_image part is served (usage counts the image's tokens)."""
    url, _ = data_url(1)
    response = client.responses.create(
        model=client.models.list().data[0].id,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Describe"},
                    {"type": "input_image", "image_url": url, "detail": "auto"},
                ],
            }
        ],
        max_output_tokens=4,
        temperature=0,
    )
    assert response.usage is not None and response.usage.input_tokens > 12  # the image alone is 12 tokens


def test_a_bad_image_is_a_400_and_the_server_keeps_serving(client: openai.OpenAI) -> None:
    """Bytes that are not an image: a 400 naming the part; the next request with a good image is served."""
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                }
            ],
            max_tokens=2,
        )
    assert cast(dict[str, Any], info.value.body)["param"] == "messages[0].content[0].image_url"
    url, _ = data_url(2)
    ok = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
        max_tokens=2,
    )
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_the_placeholder_written_as_text_is_text(client: openai.OpenAI) -> None:
    """The image pad token typed into a text message (no image part) is served as text, never a crash."""
    done = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "what is <|image_pad|> here?"}],
        max_tokens=2,
    )
    assert done.choices[0].finish_reason in ("length", "stop")
