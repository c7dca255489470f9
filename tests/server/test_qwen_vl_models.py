"""Qwen2-VL and Qwen2.5-VL (tiny, float32) against transformers: vision tower, M-RoPE positions, prompt logits
on a paged KV cache, greedy decoding, and the prompt processor's errors."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from pagoda.pagedkernel import KernelBackend
from pagoda.server.loader import load_model
from pagoda.server.models import build_model
from pagoda.server.models.qwen2_vl import Qwen2VLForConditionalGeneration
from pagoda.server.models.vision import StepImages
from pagoda.server.multimodal.inputs import ProcessedPrompt
from pagoda.server.multimodal.processors.qwen2_vl import IMAGE_MARKER, IMAGE_PAD, Qwen2VLPromptProcessor
from pagoda.server.multimodal.registry import processor_for
from pagoda.server.testing.paged_kv import PagedKV
from pagoda.server.testing.tiny_qwen_vl import QWEN_VL_ARCHS, make_tiny_qwen_vl
from PIL import Image
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForImageTextToText, PreTrainedModel

CPU = torch.device("cpu")
# float32 throughout: outputs are O(1-10) and each comes from a few hundred-term dot products in another summation
# order than transformers' (one linear for its Conv3d, SDPA for its eager attention, oneDNN for its matmuls), so
# the two differ by a few ulps per op (~1e-6 measured); 1e-4 leaves two orders of margin yet catches any real error.
ATOL = 1e-4


@dataclass(frozen=True)
class Pair:
    """Our model, the transformers reference and our processor, from one tiny folder."""

    ours: Qwen2VLForConditionalGeneration
    reference: PreTrainedModel
    processor: Qwen2VLPromptProcessor
    path: Path


@pytest.fixture(scope="module", params=QWEN_VL_ARCHS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """Each architecture's tiny folder, loaded both ways."""
    arch = str(request.param)
    path = make_tiny_qwen_vl(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
    ours = load_model(str(path), dtype=torch.float32, device=CPU).model
    assert isinstance(ours, Qwen2VLForConditionalGeneration)
    reference = AutoModelForImageTextToText.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    )
    processor = processor_for(path, AutoConfig.from_pretrained(path))
    assert isinstance(processor, Qwen2VLPromptProcessor)
    return Pair(ours, nn.Module.eval(reference), processor, path)


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    """A random RGB picture (every patch differs)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


# 56x56: a 4x4 patch grid (4 tokens); 112x84: 6x8 (12 tokens, several Qwen2.5-VL windows of 2x2 merged units).
SMALL, WIDE = (56, 56), (112, 84)


def chat_prompt(pair: Pair, parts: Sequence[str | None]) -> str:
    """The chat template's prompt of one user turn: a text part per string, an image part per None."""
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    messages: Any = [{"role": "user", "content": content}]
    prompt = pair.processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert isinstance(prompt, str)
    return prompt


PROMPTS: dict[str, tuple[list[str | None], list[tuple[int, int]]]] = {
    "one_image": (["Describe", None, "please."], [WIDE]),
    "two_images": (["Compare", None, "with", None, "now."], [WIDE, SMALL]),
    "text_only": (["Hello world! How are you today?"], []),
}


def processed(pair: Pair, name: str) -> tuple[ProcessedPrompt, list[Image.Image]]:
    """One of PROMPTS through our processor."""
    parts, sizes = PROMPTS[name]
    images = [noise_image(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    return pair.processor.process(chat_prompt(pair, parts), images), images


def hf_inputs(pair: Pair, prompt: ProcessedPrompt) -> dict[str, Tensor]:
    """transformers' model inputs for our processed prompt (batch of one)."""
    ids = torch.tensor([prompt.token_ids])
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == pair.reference.config.image_token_id).int(),
    }
    items = prompt.multi_modal.images
    if items:
        inputs["pixel_values"] = torch.cat([item.tensors["pixel_values"] for item in items])
        inputs["image_grid_thw"] = torch.cat([item.tensors["image_grid_thw"] for item in items])
    return inputs


def step_images(
    model: Qwen2VLForConditionalGeneration, prompt: ProcessedPrompt, start: int, end: int
) -> StepImages:
    """What the runner hands the model for prompt tokens [start, end): their image rows and M-RoPE positions."""
    mm = prompt.multi_modal
    embeds = model.encode_images(mm.images)
    rows, chosen = [], []
    for item, embed in zip(mm.images, embeds, strict=True):
        lo, hi = max(item.offset, start), min(item.end, end)
        if lo < hi:
            rows.append(torch.arange(lo, hi) - start)
            chosen.append(embed[lo - item.offset : hi - item.offset])
    hidden = model.model.norm.weight.shape[0]
    assert mm.mrope_positions is not None
    return StepImages(
        rows=torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64),
        embeds=torch.cat(chosen) if chosen else torch.zeros(0, hidden),
        mrope_positions=mm.mrope_positions[:, start:end],
    )


def test_vision_tower_matches_hf(pair: Pair) -> None:
    """Two images of different sizes in one pass: each image's rows equal transformers' image features."""
    prompt, _ = processed(pair, "two_images")
    got = pair.ours.encode_images(prompt.multi_modal.images)
    inputs = hf_inputs(pair, prompt)
    with torch.no_grad():
        want = pair.reference.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"]
        ).pooler_output
    assert [g.shape for g in got] == [w.shape for w in want] == [(12, 64), (4, 64)]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", PROMPTS)
def test_mrope_positions_match_get_rope_index(pair: Pair, name: str) -> None:
    """The processor's [3, prompt_len] positions and delta equal transformers' `get_rope_index`."""
    prompt, _ = processed(pair, name)
    inputs = hf_inputs(pair, prompt)
    with torch.no_grad():
        want, delta = pair.reference.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw")
        )
    mm = prompt.multi_modal
    assert mm.mrope_positions is not None
    assert torch.equal(mm.mrope_positions, want[:, 0])
    assert mm.mrope_delta == int(delta)
    # Each image's span holds exactly the pad tokens it expanded to.
    pad = pair.reference.config.image_token_id
    assert sum(1 for t in prompt.token_ids if t == pad) == mm.num_image_tokens
    for item in mm.images:
        assert set(prompt.token_ids[item.offset : item.end]) == {pad}


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logits_match_hf(pair: Pair, torch_backend: KernelBackend, chunk: int | None) -> None:
    """Two images' prompt on the paged cache (whole, or in 7-token chunks that cut through the images): every
    position's logits equal transformers' forward."""
    prompt, _ = processed(pair, "two_images")
    ids = list(prompt.token_ids)
    kv = PagedKV(pair.ours.kv_cache_spec(), torch_backend, block_size=4)
    got = []
    size = chunk or len(ids)
    with torch.inference_mode():
        for start in range(0, len(ids), size):
            end = min(start + size, len(ids))
            step = kv.step([(0, ids[start:end])])
            images = step_images(pair.ours, prompt, start, end)
            hidden = pair.ours(step.input_ids, step.positions, kv.kv_caches, step.attn, images)
            got.append(pair.ours.compute_logits(hidden))
    with torch.no_grad():
        want = pair.reference(**hf_inputs(pair, prompt)).logits[0]
    torch.testing.assert_close(torch.cat(got), want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ["two_images", "text_only"])
def test_greedy_decoding_matches_hf_generate(pair: Pair, torch_backend: KernelBackend, name: str) -> None:
    """The prompt in one step, then one token per step at position p + delta: transformers' greedy tokens."""
    prompt, _ = processed(pair, name)
    ids = list(prompt.token_ids)
    delta = prompt.multi_modal.mrope_delta
    kv = PagedKV(pair.ours.kv_cache_spec(), torch_backend, block_size=4)
    new_tokens = 6
    got: list[int] = []
    with torch.inference_mode():
        step = kv.step([(0, ids)])
        hidden = pair.ours(
            step.input_ids,
            step.positions,
            kv.kv_caches,
            step.attn,
            step_images(pair.ours, prompt, 0, len(ids)),
        )
        got.append(int(pair.ours.compute_logits(hidden[step.last_rows]).argmax(-1)))
        while len(got) < new_tokens:
            step = kv.step([(0, [got[-1]])])
            images = StepImages(
                rows=torch.zeros(0, dtype=torch.int64),
                embeds=torch.zeros(0, pair.ours.model.norm.weight.shape[0]),
                mrope_positions=(step.positions + delta).expand(3, -1),
            )
            hidden = pair.ours(step.input_ids, step.positions, kv.kv_caches, step.attn, images)
            got.append(int(pair.ours.compute_logits(hidden).argmax(-1)))
    with torch.no_grad():
        out = cast(Any, pair.reference).generate(
            **hf_inputs(pair, prompt), max_new_tokens=new_tokens, do_sample=False
        )
    assert got == out[0, len(ids) :].tolist()


def test_text_only_forward_without_images_is_plain_rope(pair: Pair, torch_backend: KernelBackend) -> None:
    """Without StepImages a text prompt's logits equal the M-RoPE run (text positions are equal on all axes)."""
    prompt, _ = processed(pair, "text_only")
    ids = list(prompt.token_ids)
    logits = []
    for images in (None, step_images(pair.ours, prompt, 0, len(ids))):
        kv = PagedKV(pair.ours.kv_cache_spec(), torch_backend, block_size=4)
        step = kv.step([(0, ids)])
        with torch.inference_mode():
            logits.append(
                pair.ours.compute_logits(
                    pair.ours(step.input_ids, step.positions, kv.kv_caches, step.attn, images)
                )
            )
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_processor_errors(pair: Pair) -> None:
    """Markers and images that disagree in number raise ValueError naming both counts."""
    image = noise_image(*SMALL, seed=0)
    with pytest.raises(ValueError, match=r"1 image marker.*2 image"):
        pair.processor.process(f"a {IMAGE_MARKER} b", [image, image])
    with pytest.raises(ValueError, match=r"2 image marker.*1 image"):
        pair.processor.process(f"a {IMAGE_MARKER} b {IMAGE_MARKER}", [image])
    with pytest.raises(ValueError, match=r"0 image marker.*1 image"):
        pair.processor.process("no marker here", [image])


def test_pad_token_written_as_text_is_text(pair: Pair) -> None:
    """A `<|image_pad|>` typed in the prompt stays one text token outside the image's span."""
    prompt = pair.processor.process(f"say {IMAGE_PAD} then {IMAGE_MARKER} end", [noise_image(*SMALL, seed=0)])
    (item,) = prompt.multi_modal.images
    pad = pair.reference.config.image_token_id
    stray = [i for i, t in enumerate(prompt.token_ids) if t == pad and not item.offset <= i < item.end]
    assert len(stray) == 1 and item.length == 4
    assert prompt.multi_modal.mrope_positions is not None
    assert prompt.multi_modal.mrope_positions.shape == (3, len(prompt.token_ids))
    text_only = pair.processor.process(f"say {IMAGE_PAD}", [])
    assert text_only.multi_modal.images == () and text_only.multi_modal.mrope_delta == 0


def test_loads_transformers_5_module_names(pair: Pair, tmp_path: Path) -> None:
    """A checkpoint with transformers 5's in-memory names (`model.language_model.*`, `model.visual.*`) loads
    into the same parameters."""
    weights = load_file(str(pair.path / "model.safetensors"))
    renamed = {
        (
            "model.language_model." + k[len("model.") :]
            if k.startswith("model.")
            else "model.visual." + k[len("visual.") :]
            if k.startswith("visual.")
            else k
        ): v
        for k, v in weights.items()
    }
    assert any(k.startswith("model.language_model.layers.") for k in renamed)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (tmp_path / name).write_bytes((pair.path / name).read_bytes())
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model(str(tmp_path), dtype=torch.float32, device=CPU).model
    ours = dict(pair.ours.named_parameters())
    for name, param in loaded.named_parameters():
        assert torch.equal(param, ours[name]), name


def test_build_registers_both_architectures(pair: Pair) -> None:
    """Both architectures build from their configs through the registry (uninitialised, M-RoPE)."""
    config = AutoConfig.from_pretrained(pair.path)
    model = build_model(config, torch.float32, CPU)
    assert type(model) is type(pair.ours) and model.uses_mrope
    assert json.loads((pair.path / "config.json").read_text())["architectures"][0] == type(model).__name__
