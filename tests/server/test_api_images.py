"""Images through the API (issue 38) with a fake engine and a fake multimodal processor: chat image_url parts,
Responses input_image parts and /tokenize reach the processor in order and the engine with their images; every
refusal is an OpenAI-shaped 400 naming the field, and the server keeps serving after it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from api_fake_engine import FakeEngine, RunningServer, serve_in_thread
from media_support import IMAGE_TOKENS, MARKER, FakeProcessor, Route, data_url, image_bytes, media_server
from pagoda.server.api.images import ImageFront
from pagoda.server.engine import RequestRejectedError
from pagoda.server.multimodal import MultiModalInputs, ProcessedPrompt, content_key
from pagoda.server.multimodal.media import MediaPolicy
from pagoda.server.sampling_params import SamplingParams
from PIL import Image

# A content-list template (as vision models' are): an image part becomes the marker, text parts their text.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    + MARKER
    + "{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


class RecordingEngine(FakeEngine):
    """The fake engine, keeping what each request was submitted with."""

    def __init__(self) -> None:
        super().__init__(max_model_len=512, chat_template=TEMPLATE)
        self.submitted: dict[str, tuple[list[int], MultiModalInputs | None]] = {}

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> None:
        """Record, then queue as the fake does."""
        self.submitted[request_id] = (list(prompt_token_ids), multi_modal)
        super().add_request(
            request_id,
            prompt_token_ids,
            params,
            prompt=prompt,
            arrival_time=arrival_time,
            multi_modal=multi_modal,
        )


@dataclass
class Served:
    """A running server over the recording engine and its processor (None: a text-only model)."""

    running: RunningServer
    engine: RecordingEngine
    processor: FakeProcessor | None

    def chat(self, content: Any, **extra: Any) -> httpx.Response:
        """POST a one-user-message chat request."""
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3, **extra}
        return httpx.post(f"{self.running.base_url}/v1/chat/completions", json=body, timeout=30)

    def last(self) -> tuple[list[int], MultiModalInputs | None]:
        """What the last request was submitted with."""
        return list(self.engine.submitted.values())[-1]


def serve(processor: bool, policy: MediaPolicy | None = None) -> Iterator[Served]:
    """The server, with the fake processor or as a text-only model."""
    engine = RecordingEngine()
    fake = FakeProcessor(engine.tokenizer, engine.tokenizer.get_vocab()["?"]) if processor else None
    images = ImageFront(fake, policy or MediaPolicy(max_images_per_prompt=2))
    with serve_in_thread(engine, images=images) as running:
        yield Served(running, engine, fake)


@pytest.fixture(scope="module")
def vision() -> Iterator[Served]:
    """A server whose model takes images (at most 2 per prompt)."""
    yield from serve(True)


@pytest.fixture(scope="module")
def text_only() -> Iterator[Served]:
    """A server whose model takes no images."""
    yield from serve(False)


RED = data_url(image_bytes("PNG", (6, 4), (255, 0, 0)))
BLUE = data_url(image_bytes("JPEG", (3, 5), (0, 0, 255)), "image/jpeg")


def bad(response: httpx.Response, param: str, message: str = "") -> None:
    """An OpenAI-shaped 400 naming `param`."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, param)
    assert message in error["message"]


def still_serving(served: Served) -> None:
    """A plain request after a refusal is served."""
    response = served.chat("hi again")
    assert response.status_code == 200, response.text


def test_openai_client_image_parts_reach_the_processor_and_the_engine(vision: Served) -> None:
    assert vision.processor is not None
    client = openai.OpenAI(base_url=f"{vision.running.base_url}/v1", api_key="unused")
    before = len(vision.processor.calls)
    completion = client.chat.completions.create(
        model="test-model",
        max_tokens=3,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "compare "},
                    {"type": "image_url", "image_url": {"url": RED, "detail": "low"}},
                    {"type": "text", "text": " and "},
                    {"type": "image_url", "image_url": {"url": BLUE}},
                ],
            }
        ],
    )
    (prompt, images) = vision.processor.calls[before]
    assert (
        prompt
        == f"<bos><start_of_turn>user\ncompare {MARKER} and {MARKER}<end_of_turn>\n<start_of_turn>model\n"
    )
    assert [(im.mode, im.size) for im in images] == [("RGB", (6, 4)), ("RGB", (3, 5))]
    assert images[0].getpixel((0, 0)) == (255, 0, 0)
    token_ids, multi_modal = vision.last()
    assert multi_modal is not None and len(multi_modal.images) == 2
    assert [item.content_key for item in multi_modal.images] == [content_key(im) for im in images]
    placeholder = vision.engine.tokenizer.convert_tokens_to_ids("?")
    for item in multi_modal.images:
        assert token_ids[item.offset : item.end] == [placeholder] * IMAGE_TOKENS
    # usage counts the image tokens: the prompt the engine got, placeholders included.
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(token_ids)
    text_len = len(vision.engine.tokenizer.encode(prompt.replace(MARKER, ""), add_special_tokens=False))
    assert completion.usage.prompt_tokens == text_len + 2 * IMAGE_TOKENS


def test_bare_string_image_url_and_streaming(vision: Served) -> None:
    response = vision.chat([{"type": "image_url", "image_url": RED}, {"type": "text", "text": "what?"}])
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(vision.last()[0])
    with httpx.stream(
        "POST",
        f"{vision.running.base_url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": RED}}]}],
            "max_tokens": 2,
            "stream": True,
        },
        timeout=30,
    ) as stream:
        assert stream.status_code == 200
        assert "[DONE]" in stream.read().decode()
    multi_modal = vision.last()[1]
    assert multi_modal is not None and len(multi_modal.images) == 1


def test_text_only_requests_are_unchanged(vision: Served) -> None:
    """No image part: the processor is not called and the prompt is the tokenizer's encoding, as before."""
    assert vision.processor is not None
    calls = len(vision.processor.calls)
    for content in ("hello there", [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]):
        assert vision.chat(content).status_code == 200
        token_ids, multi_modal = vision.last()
        text = "hello there" if isinstance(content, str) else "hello\nthere"
        rendered = f"<bos><start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
        assert (token_ids, multi_modal) == (
            vision.engine.tokenizer.encode(rendered, add_special_tokens=False),
            None,
        )
    assert len(vision.processor.calls) == calls


def test_more_images_than_the_limit(vision: Served) -> None:
    part = {"type": "image_url", "image_url": {"url": RED}}
    response = vision.chat([part, {"type": "text", "text": "x"}, part, part])
    bad(response, "messages[0].content[3].image_url", "at most 2 images per prompt")
    still_serving(vision)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,@@not base64@@", "base64 is invalid"),
        (data_url(b"just some text"), "not a PNG, JPEG or WebP"),
        (data_url(image_bytes("GIF")), "a GIF image"),
        ("ftp://example.com/cat.png", "must be a data:, http(s)"),
        ("file:///etc/passwd", "file:// images are refused"),
    ],
)
def test_bad_images_are_named_400s(vision: Served, url: str, message: str) -> None:
    response = vision.chat(
        [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]
    )
    bad(response, "messages[0].content[1].image_url", message)
    still_serving(vision)


def test_over_the_pixel_cap() -> None:
    for served in serve(True, MediaPolicy(max_image_pixels=20)):
        response = served.chat([{"type": "image_url", "image_url": {"url": RED}}])
        bad(
            response, "messages[0].content[0].image_url", "6x4 = 24 pixels, more than --max-image-pixels (20)"
        )
        still_serving(served)


def test_disallowed_url_makes_no_connection_and_an_allowed_one_is_fetched() -> None:
    with media_server() as media:
        media.routes["/cat.png"] = Route(body=image_bytes("PNG", (7, 7)))
        url = f"{media.url}/cat.png"
        for served in serve(True):
            bad(
                served.chat([{"type": "image_url", "image_url": {"url": url}}]),
                "messages[0].content[0].image_url",
                "not in --allowed-media-domains",
            )
        assert media.requested == []
        for served in serve(True, MediaPolicy(allowed_media_domains=("127.0.0.1",))):
            assert served.chat([{"type": "image_url", "image_url": {"url": url}}]).status_code == 200
            assert served.processor is not None and served.processor.calls[-1][1][0].size == (7, 7)
        assert media.requested == ["/cat.png"]


def test_text_only_model_refuses_images(text_only: Served) -> None:
    response = text_only.chat(
        [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": RED}}]
    )
    bad(response, "messages[0].content[1].image_url", "the model does not take images")
    # The marker of no model means nothing to a text-only one: plain text.
    assert text_only.chat(f"a {MARKER} b").status_code == 200
    still_serving(text_only)


def test_the_image_marker_written_as_text_is_refused(vision: Served) -> None:
    bad(vision.chat(f"see {MARKER} here"), "messages[0].content", "image marker")
    bad(
        vision.chat(
            [{"type": "text", "text": f"x{MARKER}"}, {"type": "image_url", "image_url": {"url": RED}}]
        ),
        "messages[0].content[0].text",
        "image marker",
    )
    still_serving(vision)


def test_images_only_in_user_messages(vision: Served) -> None:
    body = {
        "messages": [
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": RED}}]},
            {"role": "user", "content": "hi"},
        ],
        "max_tokens": 2,
    }
    response = httpx.post(f"{vision.running.base_url}/v1/chat/completions", json=body, timeout=30)
    bad(response, "messages[0].content[0].image_url", "user messages only")


def test_malformed_image_parts(vision: Served) -> None:
    bad(vision.chat([{"type": "image_url"}]), "messages")
    bad(vision.chat([{"type": "image_url", "image_url": {"uri": RED}}]), "messages")
    bad(vision.chat([{"type": "image_url", "image_url": {"url": RED, "detail": "ultra"}}]), "messages")
    still_serving(vision)


def test_processor_refusal_is_a_400(vision: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """A template that wrote no marker for an image: the processor's ValueError is a 400, not a 500."""
    assert vision.processor is not None

    def refuse(
        prompt: str, images: Sequence[Image.Image], *, add_special_tokens: bool = True
    ) -> ProcessedPrompt:
        raise ValueError("0 image markers but 1 images")

    monkeypatch.setattr(vision.processor, "process", refuse)
    bad(vision.chat([{"type": "image_url", "image_url": {"url": RED}}]), "messages", "cannot be placed")


def test_engine_rejection_with_images_is_still_a_400(vision: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    def reject(*args: object, **kwargs: object) -> None:
        raise RequestRejectedError("the image does not fit", "messages")

    monkeypatch.setattr(vision.engine, "add_request", reject)
    bad(vision.chat([{"type": "image_url", "image_url": {"url": RED}}]), "messages", "does not fit")


def test_responses_input_image(vision: Served) -> None:
    assert vision.processor is not None
    body = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is this"},
                    {"type": "input_image", "image_url": BLUE, "detail": "auto"},
                ],
            }
        ],
        "max_output_tokens": 3,
    }
    response = httpx.post(f"{vision.running.base_url}/v1/responses", json=body, timeout=30)
    assert response.status_code == 200, response.text
    prompt, images = vision.processor.calls[-1]
    assert f"what is this{MARKER}" in prompt and [im.size for im in images] == [(3, 5)]
    token_ids, multi_modal = vision.last()
    assert multi_modal is not None and len(multi_modal.images) == 1
    assert response.json()["usage"]["input_tokens"] == len(token_ids)
    body["input"][0]["content"][1] = {"type": "input_image", "image_url": "data:image/png;base64,!!"}  # type: ignore[index]
    bad(
        httpx.post(f"{vision.running.base_url}/v1/responses", json=body, timeout=30),
        "input",
        "base64 is invalid",
    )
    body["input"][0]["content"][1] = {"type": "input_image", "file_id": "file-1"}  # type: ignore[index]
    bad(httpx.post(f"{vision.running.base_url}/v1/responses", json=body, timeout=30), "input", "file_id")
    still_serving(vision)


def test_tokenize_counts_image_tokens(vision: Served) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": RED}}]}]}
    response = httpx.post(f"{vision.running.base_url}/tokenize", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["tokens"].count(vision.engine.tokenizer.convert_tokens_to_ids("?")) == IMAGE_TOKENS


def test_anthropic_client_image_blocks_reach_the_processor(vision: Served) -> None:
    """The official anthropic client's image blocks (base64 source) beside text reach the processor in order, and
    the request carries the images; an image in a tool result is refused in Anthropic's error shape."""
    import anthropic

    assert vision.processor is not None
    client = anthropic.Anthropic(base_url=vision.running.base_url, api_key="unused")
    before = len(vision.processor.calls)
    red = RED.removeprefix("data:image/png;base64,")
    message = client.messages.create(
        model="test-model",
        max_tokens=3,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": red}},
                ],
            }
        ],
    )
    assert message.usage.input_tokens > 0
    prompt, images = vision.processor.calls[before]
    assert prompt.count(MARKER) == 1 and prompt.index("what is") < prompt.index(MARKER)
    assert [im.getpixel((0, 0)) for im in images] == [(255, 0, 0)]
    _, multi_modal = vision.last()
    assert multi_modal is not None and len(multi_modal.images) == 1
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="test-model",
            max_tokens=3,
            messages=[
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [
                                {
                                    "type": "image",
                                    "source": {"type": "base64", "media_type": "image/png", "data": red},
                                }
                            ],
                        }
                    ],
                },
            ],
        )
    assert "tool result" in str(info.value)
