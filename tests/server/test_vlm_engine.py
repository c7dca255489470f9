"""Vision-language models through the whole engine against transformers' float32 greedy `generate`, token for
token: one image, two images, text only, eight concurrent different images, under preemption and chunked prefill,
with the prefix cache hitting on a repeated image and never on a different one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from pagoda.server.engine import LLMEngine
from pagoda.server.engine.setup import MaxModelLenError
from pagoda.server.llm import LLM
from pagoda.server.multimodal import ProcessedPrompt
from pagoda.server.multimodal.processor import MultiModalProcessor
from pagoda.server.multimodal.registry import processor_for
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing.tiny_qwen_vl import make_tiny_qwen_vl
from pagoda.server.testing.tiny_vlm import make_tiny_vlm
from PIL import Image
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer, PreTrainedModel

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Architecture -> its tiny folder's maker.
MAKERS: dict[str, Callable[[str, Path], Path]] = {
    "llava": make_tiny_vlm,
    "gemma3_vl": make_tiny_vlm,
    "qwen2_vl": make_tiny_qwen_vl,
    "qwen2_5_vl": make_tiny_qwen_vl,
}
SIZES = ((112, 84), (56, 56))  # image sizes the tiny processors take


@dataclass
class Model:
    """One tiny VLM folder: its processor and the transformers reference (loaded once per module)."""

    arch: str
    path: Path
    processor: MultiModalProcessor
    reference: PreTrainedModel
    tokenizer: Any  # the folder's tokenizer and chat template

    def prompt(self, parts: Sequence[str | Image.Image]) -> ProcessedPrompt:
        """One user turn of text parts and images, through the chat template and the processor."""
        content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        # As the server does: the rendered template writes the special tokens itself.
        images = [p for p in parts if isinstance(p, Image.Image)]
        return self.processor.process(text, images, add_special_tokens=False)

    def greedy(self, prompt: ProcessedPrompt, max_tokens: int = MAX_TOKENS) -> list[int]:
        """transformers' greedy tokens for the prompt alone."""
        ids = torch.tensor([prompt.token_ids])
        inputs: dict[str, Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        config = cast(Any, self.reference.config)
        if config.model_type.startswith("qwen2"):
            inputs["mm_token_type_ids"] = (ids == config.image_token_id).int()
        if config.model_type == "gemma3":  # marks the image soft tokens, attended both ways
            inputs["token_type_ids"] = (ids == config.image_token_id).long()
        items = prompt.multi_modal.images
        for name in items[0].tensors if items else ():
            inputs[name] = torch.cat([item.tensors[name] for item in items])
        with torch.no_grad():
            out = cast(Any, self.reference).generate(
                # No stop token: an EOS is drawn like any other token, as the engine's ignore_eos does
                # (min_new_tokens would instead mask EOS out and pick the runner-up).
                **inputs,
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=[],
                pad_token_id=0,
            )
        return cast(list[int], out[0, ids.shape[1] :].tolist())


@pytest.fixture(scope="module", params=sorted(MAKERS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    """Each architecture's tiny folder."""
    arch = str(request.param)
    path = MAKERS[arch](arch, tmp_path_factory.mktemp(f"vlm-{arch}"))
    processor = processor_for(path, AutoConfig.from_pretrained(path))
    assert processor is not None
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return Model(arch, path, processor, nn.Module.eval(reference), AutoTokenizer.from_pretrained(path))


def picture(seed: int, size: tuple[int, int] = SIZES[0]) -> Image.Image:
    """A random RGB picture."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def make_llm(model: Model, **kwargs: Any) -> LLM:
    """An engine on the tiny VLM: block size 4, float32 like the reference."""
    args: dict[str, Any] = {"block_size": 4, "num_kv_blocks": 256, "max_model_len": 160, "dtype": "float32"}
    args.update(kwargs)
    return LLM(str(model.path), **args)


def run(
    engine: LLMEngine, prompts: Sequence[ProcessedPrompt], params: SamplingParams = GREEDY
) -> list[RequestOutput]:
    """Add every prompt, step until done; the final outputs in prompt order."""
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt.token_ids, params, multi_modal=prompt.multi_modal)
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    return [final[str(i)] for i in range(len(prompts))]


def tokens(outputs: Sequence[RequestOutput]) -> list[list[int]]:
    """Each output's generated token ids."""
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_one_image_two_images_and_text_match_transformers(model: Model) -> None:
    """A batch of a one-image, a two-image and a text-only prompt equals transformers' generate of each alone;
    prompt_tokens counts the image tokens."""
    prompts = [
        model.prompt(["Describe", picture(0), "please."]),
        model.prompt(["Compare", picture(1), "with", picture(2, SIZES[1]), "now."]),
        model.prompt(["Hello world! How are you today?"]),
    ]
    outputs = run(make_llm(model).engine, prompts)
    assert tokens(outputs) == [model.greedy(p) for p in prompts]
    assert [len(o.prompt_token_ids) for o in outputs] == [len(p.token_ids) for p in prompts]
    assert prompts[0].multi_modal.num_image_tokens > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_eight_concurrent_images_under_preemption_and_chunked_prefill(model: Model, mode: str) -> None:
    """Eight prompts with different images, a pool too small for all of them and 16-token steps: every output
    still equals transformers', and the engine did preempt (by `mode`) and split prefills."""
    prompts = [model.prompt(["Look:", picture(10 + i), "What is it?"]) for i in range(8)]
    # A pool of three of the longest sequences (KV cache groups share it: Gemma 3's sliding layers take blocks of
    # their own): eight sequences cannot all fit, and the ones admitted by their prompts' footprint outgrow it as
    # they decode, so the batch preempts. (Smaller pools admit fewer at once, whose prefill chunks shrink to fit
    # and whose windows give blocks back: with Gemma 3 at one and a half, nothing is ever preempted.)
    long = SamplingParams(temperature=0.0, max_tokens=3 * MAX_TOKENS, ignore_eos=True)
    max_len = -(-(max(len(p.token_ids) for p in prompts) + 3 * MAX_TOKENS) // 4) * 4
    flags: dict[str, Any] = {
        "max_model_len": max_len,
        "max_num_batched_tokens": 32,
        "enable_chunked_prefill": True,
        "preemption_mode": mode,
        "swap_space_gib": 0.01,
    }
    smallest = next(n for n in range(max_len // 4, 8 * max_len) if _fits(model, n, flags))
    llm = make_llm(model, num_kv_blocks=smallest * 3, **flags)
    engine = llm.engine
    outputs = run(engine, prompts, long)
    assert tokens(outputs) == [model.greedy(p, 3 * MAX_TOKENS) for p in prompts]
    assert engine.get_stats().num_preemptions > 0
    assert engine.images is not None and engine.images.num_cached_tokens == 0  # every image's rows dropped


def test_parallel_samples_fork_an_image_prompt(model: Model) -> None:
    """n=3 greedy samples of an image prompt fork its blocks (copy-on-write) and all equal transformers'."""
    prompt = model.prompt(["Describe", picture(3), "please."])
    engine = make_llm(model).engine
    engine.add_request(
        "n",
        prompt.token_ids,
        SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        multi_modal=prompt.multi_modal,
    )
    final = [o for o in _drain(engine) if o.finished]
    assert [list(s.token_ids) for s in final[-1].outputs] == [model.greedy(prompt)] * 3


def _fits(model: Model, num_blocks: int, flags: dict[str, Any]) -> bool:
    """Whether a pool of `num_blocks` holds one sequence of the flags' max_model_len."""
    try:
        make_llm(model, num_kv_blocks=num_blocks, **flags)
    except MaxModelLenError:
        return False
    return True


def _drain(engine: LLMEngine) -> list[RequestOutput]:
    """Step until idle; every snapshot."""
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_prefix_cache_hits_the_same_image_only(model: Model) -> None:
    """The same image again is a cache hit past the image (and the output is the same); another image behind the
    same text hits only the blocks before the image."""
    engine = make_llm(model).engine
    first = model.prompt(["Describe", picture(0), "please."])
    (out,) = run(engine, [first])
    image_end = first.multi_modal.images[0].end
    (again,) = run(engine, [model.prompt(["Describe", picture(0), "please."])])
    assert again.num_cached_tokens is not None and again.num_cached_tokens >= image_end - 4
    assert tokens([again]) == tokens([out])
    other = model.prompt(["Describe", picture(5), "please."])
    (changed,) = run(engine, [other])
    assert (changed.num_cached_tokens or 0) <= other.multi_modal.images[0].offset
    assert tokens([changed]) == [model.greedy(other)]


def test_a_text_only_model_refuses_images(tmp_path: Path) -> None:
    """Images sent to a text-only model are refused naming the messages (nothing is queued)."""
    from pagoda.server.engine import RequestRejectedError
    from pagoda.server.multimodal import ImageItem, MultiModalInputs
    from pagoda.server.testing import make_tiny_model

    llm = LLM(
        str(make_tiny_model("llama", tmp_path / "llama")), block_size=4, num_kv_blocks=32, max_model_len=32
    )
    images = MultiModalInputs((ImageItem(1, 2, -5, {}),))
    with pytest.raises(RequestRejectedError) as info:
        llm.engine.add_request("x", [5, 6, 7, 8], GREEDY, multi_modal=images)
    assert info.value.param == "messages"
    assert not llm.engine.has_unfinished_requests()


def test_special_tokens_follow_the_caller(model: Model) -> None:
    """A raw prompt gets the tokenizer's special tokens (BOS) and a rendered chat template does not (it writes
    its own): the image spans move with them."""
    text = f"Look: {model.processor.image_marker} now."
    raw = model.processor.process(text, [picture(0)])
    chat = model.processor.process(text, [picture(0)], add_special_tokens=False)
    bos = model.tokenizer("x")["input_ids"][:1] if model.tokenizer.bos_token_id is not None else []
    extra = len(raw.token_ids) - len(chat.token_ids)
    assert extra == len([t for t in bos if t == model.tokenizer.bos_token_id])
    assert raw.token_ids[extra:] == chat.token_ids
    assert raw.multi_modal.images[0].offset == chat.multi_modal.images[0].offset + extra


def test_offline_generate_and_chat_take_images(model: Model) -> None:
    """`LLM.generate` with vLLM's multi_modal_data (a PIL image) and `LLM.chat` with an image_url data URL give
    transformers' greedy tokens."""
    import base64
    import io

    image = picture(7)
    llm = make_llm(model)
    text = f"Look: {model.processor.image_marker} What is it?"
    (generated,) = llm.generate(
        {"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False
    )
    assert list(generated.outputs[0].token_ids) == model.greedy(model.processor.process(text, [image]))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages: Any = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]
    (chatted,) = llm.chat(messages, GREEDY, use_tqdm=False)
    assert list(chatted.outputs[0].token_ids) == model.greedy(model.prompt(["Describe", image]))
