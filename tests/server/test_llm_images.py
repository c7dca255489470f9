"""The offline API's images (issue 38): vLLM's dict prompt and LLM.chat's image parts reach the model's processor
and the engine; refusals are ValueErrors naming the argument; vLLM's tokens dict prompt beside them. A fake
processor on a tiny text model (the engine gets the token ids; its multi_modal is recorded here, the vision models
are tested with their own)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from media_support import IMAGE_TOKENS, MARKER, FakeProcessor, data_url, image_bytes
from pagoda.scheduler import RequestRejectedError
from pagoda.server.llm import LLM
from pagoda.server.multimodal import MultiModalInputs
from pagoda.server.multimodal.media import MediaError
from pagoda.server.sampling_params import SamplingParams
from PIL import Image

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    + MARKER
    + "{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
)
PARAMS = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.fixture(scope="module")
def llm(tiny_model_path: Callable[[str], Path]) -> tuple[LLM, FakeProcessor, list[MultiModalInputs | None]]:
    """A tiny LLM with the fake processor, recording the multi_modal each request was added with."""
    llm = LLM(
        str(tiny_model_path("llama")), block_size=4, num_kv_blocks=128, max_model_len=256, dtype="float32"
    )
    processor = FakeProcessor(llm.tokenizer, placeholder=5)
    llm.mm_processor = processor
    llm.tokenizer.chat_template = TEMPLATE
    seen: list[MultiModalInputs | None] = []
    add = llm.engine.add_request

    def record(request_id: str, token_ids: Sequence[int], params: SamplingParams, **kwargs: Any) -> None:
        seen.append(kwargs.pop("multi_modal", None))
        add(request_id, token_ids, params, **kwargs)

    llm.engine.add_request = record  # type: ignore[method-assign,assignment]
    return llm, processor, seen


def test_dict_prompt_with_pil_images_and_data_urls(llm: tuple[LLM, FakeProcessor, list[Any]]) -> None:
    model, processor, seen = llm
    red = Image.new("RGBA", (4, 4), (255, 0, 0, 255))
    prompt = {
        "prompt": f"a {MARKER} b {MARKER}",
        "multi_modal_data": {"image": [red, data_url(image_bytes())]},
    }
    (out,) = model.generate(prompt, PARAMS, use_tqdm=False)
    text, images = processor.calls[-1]
    assert text == f"a {MARKER} b {MARKER}" and [im.size for im in images] == [(4, 4), (8, 6)]
    assert images[0].mode == "RGB"
    assert seen[-1] is not None and len(seen[-1].images) == 2
    assert list(out.prompt_token_ids).count(5) >= 2 * IMAGE_TOKENS
    # One image, not in a list.
    model.generate({"prompt": MARKER, "multi_modal_data": {"image": red}}, PARAMS, use_tqdm=False)
    assert len(processor.calls[-1][1]) == 1


def test_chat_with_image_parts(llm: tuple[LLM, FakeProcessor, list[Any]]) -> None:
    model, processor, seen = llm
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "see "},
                {"type": "image_url", "image_url": {"url": data_url(image_bytes())}},
            ],
        }
    ]
    model.chat(messages, PARAMS, use_tqdm=False)
    assert processor.calls[-1][0] == f"user: see {MARKER}"  # (the renderer drops the final newline)
    assert seen[-1] is not None and len(seen[-1].images) == 1
    calls = len(processor.calls)
    model.chat([{"role": "user", "content": "text only"}], PARAMS, use_tqdm=False)
    assert len(processor.calls) == calls and seen[-1] is None


def test_offline_refusals_name_the_argument(
    llm: tuple[LLM, FakeProcessor, list[Any]], tmp_path: Path
) -> None:
    model, _, _ = llm
    with pytest.raises(MediaError, match="base64") as info:
        model.generate({"prompt": MARKER, "multi_modal_data": {"image": "data:image/png;base64,@@"}}, PARAMS)
    assert info.value.param == "prompts[0].multi_modal_data.image[0]"
    with pytest.raises(MediaError, match="allowed-local-media-path"):
        model.generate({"prompt": MARKER, "multi_modal_data": {"image": f"file://{tmp_path}/x.png"}}, PARAMS)
    with pytest.raises(MediaError, match="allowed-media-domains"):
        model.generate({"prompt": MARKER, "multi_modal_data": {"image": "http://127.0.0.1:9/x.png"}}, PARAMS)
    with pytest.raises(MediaError, match="at most 8 images"):
        model.generate(
            {"prompt": MARKER * 9, "multi_modal_data": {"image": [Image.new("RGB", (2, 2))] * 9}}, PARAMS
        )
    with pytest.raises(MediaError, match="image marker"):
        model.generate(f"x {MARKER}", PARAMS)
    with pytest.raises(MediaError, match=r"only \{'image'"):
        model.generate({"prompt": "x", "multi_modal_data": {"video": []}}, PARAMS)
    with pytest.raises(ValueError, match="markers"):
        model.generate(
            {"prompt": "no marker", "multi_modal_data": {"image": Image.new("RGB", (2, 2))}}, PARAMS
        )
    # Still serving.
    assert len(model.generate("hello", PARAMS, use_tqdm=False)) == 1


def test_tokens_dict_prompt(llm: tuple[LLM, FakeProcessor, list[Any]]) -> None:
    """`{"prompt_token_ids": [...]}` runs as the bare ids do; a refused prompt names its field, and the prompts
    before it in the batch are not left queued."""
    model, _, _ = llm
    ids = model.tokenizer.encode("the same tokens")
    (plain,) = model.generate(ids, PARAMS, use_tqdm=False)
    first, second = model.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": tuple(ids)}], PARAMS)
    assert list(first.prompt_token_ids) == list(second.prompt_token_ids) == ids
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == plain.outputs[0].token_ids
    vocab = model.engine.rules.vocab_size
    refusals: list[tuple[Any, str]] = [
        ({"prompt_token_ids": "abc"}, "prompts[1].prompt_token_ids"),
        ({"prompt_token_ids": [1, -1]}, "prompts[1].prompt_token_ids"),  # the engine's vocabulary check
        ({"prompt_token_ids": [1, vocab]}, "prompts[1].prompt_token_ids"),
        ({"prompt_token_ids": [1], "prompt": "x"}, "prompts[1]"),
        ([1, vocab], "prompts[1]"),  # bare ids
    ]
    for bad, field in refusals:
        with pytest.raises((MediaError, RequestRejectedError)) as info:
            model.generate([{"prompt_token_ids": ids}, bad], PARAMS, use_tqdm=False)
        assert isinstance(info.value, MediaError | RequestRejectedError) and info.value.param == field
        assert not model.engine.get_num_unfinished_requests()
    assert len(model.generate({"prompt_token_ids": ids}, PARAMS, use_tqdm=False)) == 1


def test_text_only_model_refuses_images(llm: tuple[LLM, FakeProcessor, list[Any]]) -> None:
    model, processor, _ = llm
    model.mm_processor = None
    try:
        with pytest.raises(MediaError, match="does not take images"):
            model.generate({"prompt": "x", "multi_modal_data": {"image": Image.new("RGB", (2, 2))}}, PARAMS)
        model.generate(f"x {MARKER}", PARAMS, use_tqdm=False)  # plain text to a text-only model
    finally:
        model.mm_processor = processor
