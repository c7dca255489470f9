"""Vision-language models (Llava, Gemma 3) against transformers, their processors, and bidirectional image
attention on the paged kernels."""

from __future__ import annotations

import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pagoda.pagedkernel import KernelBackend, get_backend
from pagoda.server.llm import LLM
from pagoda.server.loader import WeightLoadError, load_model
from pagoda.server.models import Attention, AttentionMetadata, LayerKVCache
from pagoda.server.models.conditional import ConditionalGeneration
from pagoda.server.models.gemma3_mm import Gemma3ForConditionalGeneration
from pagoda.server.models.image_attention import bidirectional_metadata
from pagoda.server.models.llava import LlavaForConditionalGeneration
from pagoda.server.models.registry import build_model, model_class
from pagoda.server.models.vision import StepImages, VisionLanguageModel
from pagoda.server.multimodal.inputs import ProcessedPrompt, content_key
from pagoda.server.multimodal.processor import MultiModalProcessor
from pagoda.server.multimodal.registry import processor_for
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing.paged_kv import PagedKV
from pagoda.server.testing.tiny_vlm import IMAGE_MARKERS, VLM_ARCHS, make_tiny_vlm
from PIL import Image
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel
from transformers import Gemma3ForConditionalGeneration as HFGemma3
from transformers import LlavaForConditionalGeneration as HFLlava

CPU = torch.device("cpu")


def _dense_reference(
    q: Tensor,  # [q_len, heads, d]: the chunk's queries, positions [first, first + q_len)
    keys: Tensor,  # [first + q_len, kv_heads, d]: every position's key
    values: Tensor,  # [first + q_len, kv_heads, d]
    images: list[tuple[int, int]],  # (first position, length) of each image
    scale: float,
) -> Tensor:  # [q_len, heads, d]
    """Masked dense attention: causal, plus every image's positions seeing the whole image."""
    total, q_len = keys.shape[0], q.shape[0]
    group = q.shape[1] // keys.shape[1]
    pos_q = torch.arange(total - q_len, total)[:, None]
    pos_k = torch.arange(total)[None, :]
    allowed = pos_k <= pos_q
    for start, length in images:
        inside_q = (pos_q >= start) & (pos_q < start + length)
        inside_k = (pos_k >= start) & (pos_k < start + length)
        allowed = allowed | (inside_q & inside_k)
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_bidirectional_metadata_matches_dense_masked_attention(backend_name: str) -> None:
    """Three sequences (cached context and one image, two images, no image) in one paged step, on the reference
    kernels and the CPU's C kernels."""
    backend = get_backend(backend_name, "cpu")
    heads, kv_heads, d, block, num_blocks = 4, 2, 8, 4, 32
    gen = torch.Generator().manual_seed(0)
    # (tokens already cached, chunk length, images as (offset in chunk, length))
    seqs = [(6, 17, [(3, 7)]), (0, 22, [(0, 5), (9, 6)]), (2, 5, [])]
    k_cache = torch.zeros(num_blocks, block, kv_heads, d)
    v_cache = torch.zeros(num_blocks, block, kv_heads, d)
    free = list(range(num_blocks))
    random.Random(1).shuffle(free)
    tables: list[list[int]] = []
    keys: list[Tensor] = []
    values: list[Tensor] = []
    queries: list[Tensor] = []
    slots: list[int] = []
    starts, lens = [0], []
    spans: list[tuple[int, int, int]] = []
    for index, (cached, q_len, images) in enumerate(seqs):
        total = cached + q_len
        table = [free.pop() for _ in range(-(-total // block))]
        tables.append(table)
        key = torch.randn(total, kv_heads, d, generator=gen)
        value = torch.randn(total, kv_heads, d, generator=gen)
        for pos in range(cached):  # the earlier steps' K/V, already in the cache
            k_cache[table[pos // block], pos % block] = key[pos]
            v_cache[table[pos // block], pos % block] = value[pos]
        keys.append(key)
        values.append(value)
        queries.append(torch.randn(q_len, heads, d, generator=gen))
        slots.extend(table[pos // block] * block + pos % block for pos in range(cached, total))
        starts.append(starts[-1] + q_len)
        lens.append(total)
        spans.extend((index, offset, length) for offset, length in images)
    width = max(len(t) for t in tables)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(q for _, q, _ in seqs),
        is_decode=False,
        backend=backend,
    )
    bidi = bidirectional_metadata(attn, spans)
    layer = Attention(heads, kv_heads, d, d**-0.5)
    new_k = torch.cat([k[c:] for k, (c, _, _) in zip(keys, seqs, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _, _) in zip(values, seqs, strict=True)])
    got = layer(torch.cat(queries), new_k, new_v, LayerKVCache(k_cache, v_cache), bidi)
    want = torch.cat(
        [
            _dense_reference(q, k, v, [(cached + o, n) for o, n in images], d**-0.5)
            for q, k, v, (cached, _, images) in zip(queries, keys, values, seqs, strict=True)
        ]
    ).reshape(got.shape)
    # float32 softmax over <= 28 keys of O(1) scores: a few ulps of O(1) outputs.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # Without the rewrite the image rows differ (the test can fail).
    causal = Attention(heads, kv_heads, d, d**-0.5)(
        torch.cat(queries), new_k, new_v, LayerKVCache(k_cache, v_cache), attn
    )
    assert not torch.allclose(causal, want, atol=1e-3)
    assert bidi.slot_mapping is attn.slot_mapping and not bidi.is_decode


def test_bidirectional_metadata_refuses_a_span_past_the_chunk(torch_backend: KernelBackend) -> None:
    """An image that does not lie wholly inside its chunk is refused."""
    attn = AttentionMetadata(
        slot_mapping=torch.arange(4),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        context_lens=torch.tensor([4], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
        max_query_len=4,
        is_decode=False,
        backend=torch_backend,
    )
    with pytest.raises(ValueError, match="not a disjoint part"):
        bidirectional_metadata(attn, [(0, 2, 3)])


# ---- the models against transformers -------------------------------------------------------------------------

# float32 through a few tiny layers: the two implementations order their sums differently (oneDNN vs MKL
# matmuls, SDPA vs eager attention), each rounding ~1e-7 relative on O(1-10) activations; 1e-4 on O(1) logits
# leaves a wide margin yet fails on any real difference (a wrong scale, mask or row moves logits by > 1e-2).
LOGITS_ATOL = 1e-4
# Image features: O(1-6) values after the projector, ~1e-6 apart in float32 (measured); 1e-5 bounds it.
FEATURES_ATOL = 1e-5


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`vlm_path(arch)`: the tiny `arch` folder, built on first use."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_tiny_vlm(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return built[arch]

    return get


def _image(width: int, height: int, seed: int) -> Image.Image:
    """A random RGB picture."""
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def _load(arch: str, path: Path) -> tuple[ConditionalGeneration, PreTrainedModel, MultiModalProcessor]:
    """Our model, the transformers reference (eager attention) and our processor, from one folder."""
    ours = load_model(str(path), dtype=torch.float32, device=CPU).model
    assert isinstance(ours, ConditionalGeneration)
    hf_class = HFLlava if arch == "llava" else HFGemma3
    reference = nn.Module.eval(
        hf_class.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    )
    processor = processor_for(path, AutoConfig.from_pretrained(path))
    assert processor is not None
    return ours, reference, processor


def _prompts(marker: str) -> list[tuple[str, list[Image.Image]]]:
    """A one-image and a two-image prompt (images of different sizes: the processor resizes them)."""
    return [
        (f"<|user|>Hello world! {marker} What is in the picture?<|assistant|>", [_image(40, 30, 1)]),
        (
            f"<|user|>{marker}The quick brown fox and {marker} the lazy dog: which one?<|assistant|>",
            [_image(64, 64, 2), _image(20, 50, 3)],
        ),
    ]


def _hf_inputs(reference: PreTrainedModel, prompt: ProcessedPrompt) -> dict[str, Tensor]:
    """transformers' inputs for one processed prompt (Gemma 3's token_type_ids mark the soft tokens)."""
    ids = torch.tensor([prompt.token_ids])
    pixels = torch.cat([item.tensors["pixel_values"] for item in prompt.multi_modal.images])
    inputs = {"input_ids": ids, "pixel_values": pixels, "attention_mask": torch.ones_like(ids)}
    if isinstance(reference, HFGemma3):
        inputs["token_type_ids"] = (ids == reference.config.image_token_id).long()
    return inputs


def _step_images(
    model: ConditionalGeneration, prompts: list[ProcessedPrompt], starts: list[int]
) -> StepImages:
    """The encoder rows of a step holding each prompt whole from row `starts[i]`."""
    rows = [
        torch.arange(start + item.offset, start + item.end)
        for prompt, start in zip(prompts, starts, strict=True)
        for item in prompt.multi_modal.images
    ]
    items = [item for prompt in prompts for item in prompt.multi_modal.images]
    return StepImages(torch.cat(rows), torch.cat(model.encode_images(items)))


def _prefill(
    model: ConditionalGeneration, kv: PagedKV, prompts: list[ProcessedPrompt], seq_ids: list[int]
) -> Tensor:  # [total prompt tokens, vocab]: every row's logits
    """All prompts in one paged step, images merged (bidirectional for Gemma 3)."""
    step = kv.step([(seq, list(p.token_ids)) for seq, p in zip(seq_ids, prompts, strict=True)])
    starts = step.attn.query_start_loc.tolist()
    attn = step.attn
    if model.bidirectional_images:
        spans = [
            (i, item.offset, item.length) for i, p in enumerate(prompts) for item in p.multi_modal.images
        ]
        attn = bidirectional_metadata(attn, spans)
    images = _step_images(model, prompts, starts[:-1])
    with torch.inference_mode():
        hidden = model(step.input_ids, step.positions, kv.kv_caches, attn, images)
        return model.compute_logits(hidden).float()


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_encode_images_matches_hf_image_features(arch: str, vlm_path: Callable[[str], Path]) -> None:
    """The vision tower and projector give transformers' `get_image_features` rows for each image."""
    model, reference, processor = _load(arch, vlm_path(arch))
    prompt = processor.process(*_prompts(processor.image_marker)[1])
    items = prompt.multi_modal.images
    got = model.encode_images(items)
    with torch.no_grad():
        pixels = torch.cat([item.tensors["pixel_values"] for item in items])
        want = reference.get_image_features(pixel_values=pixels).pooler_output  # type: ignore[operator]
    assert [tuple(rows.shape) for rows in got] == [(item.length, 64) for item in items]
    for rows, expected in zip(got, want, strict=True):
        torch.testing.assert_close(rows, expected, atol=FEATURES_ATOL, rtol=0)


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_prefill_logits_match_hf(
    arch: str, vlm_path: Callable[[str], Path], torch_backend: KernelBackend
) -> None:
    """A one-image and a two-image prompt in one paged step (4-token blocks): every row's logits are HF's."""
    model, reference, processor = _load(arch, vlm_path(arch))
    prompts = [processor.process(text, images) for text, images in _prompts(processor.image_marker)]
    kv = PagedKV(model.kv_cache_spec(), torch_backend, num_blocks=96, block_size=4)
    got = _prefill(model, kv, prompts, [0, 1])
    offset = 0
    for prompt in prompts:
        with torch.no_grad():
            want = reference(**_hf_inputs(reference, prompt)).logits[0].float()
        torch.testing.assert_close(
            got[offset : offset + len(prompt.token_ids)], want, atol=LOGITS_ATOL, rtol=0
        )
        offset += len(prompt.token_ids)


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_greedy_decode_matches_hf_generate(
    arch: str, vlm_path: Callable[[str], Path], torch_backend: KernelBackend
) -> None:
    """The two-image prompt in one step, then one token per step through the paged cache: HF's greedy tokens, and
    every step's logits equal to HF's over the whole sequence (the tiny model repeats tokens: the logits are the
    sharper check)."""
    model, reference, processor = _load(arch, vlm_path(arch))
    prompt = processor.process(*_prompts(processor.image_marker)[1])
    kv = PagedKV(model.kv_cache_spec(), torch_backend, num_blocks=64, block_size=4)
    steps = [_prefill(model, kv, [prompt], [0])[-1]]
    tokens = [int(steps[-1].argmax())]
    for _ in range(4):
        steps.append(kv.run(model, [(0, tokens[-1:])])[0].float())
        tokens.append(int(steps[-1].argmax()))
    inputs = _hf_inputs(reference, prompt)
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=5, do_sample=False)  # type: ignore[operator]
        assert tokens == out[0, len(prompt.token_ids) :].tolist()
        ids = torch.cat([inputs["input_ids"], torch.tensor([tokens[:-1]])], dim=1)
        whole = {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if "token_type_ids" in inputs:
            whole["token_type_ids"] = (ids == reference.config.image_token_id).long()
        want = reference(**whole).logits[0, len(prompt.token_ids) - 1 :].float()
    torch.testing.assert_close(torch.stack(steps), want, atol=LOGITS_ATOL, rtol=0)


def test_gemma3_images_need_the_bidirectional_metadata(
    vlm_path: Callable[[str], Path], torch_backend: KernelBackend
) -> None:
    """Causal-only attention over Gemma 3's image rows is not transformers' (the bidirectional test can fail)."""
    model, reference, processor = _load("gemma3_vl", vlm_path("gemma3_vl"))
    prompt = processor.process(*_prompts(processor.image_marker)[0])
    kv = PagedKV(model.kv_cache_spec(), torch_backend, num_blocks=64, block_size=4)
    step = kv.step([(0, list(prompt.token_ids))])
    with torch.inference_mode():
        hidden = model(
            step.input_ids, step.positions, kv.kv_caches, step.attn, _step_images(model, [prompt], [0])
        )
        causal = model.compute_logits(hidden)
        want = reference(**_hf_inputs(reference, prompt)).logits[0]
    image = prompt.multi_modal.images[0]
    assert not torch.allclose(causal[image.offset : image.end], want[image.offset : image.end], atol=1e-2)
    # Text before the image sees no image: identical either way.
    torch.testing.assert_close(causal[: image.offset], want[: image.offset], atol=LOGITS_ATOL, rtol=0)


# ---- weight loading --------------------------------------------------------------------------------------------

# The saved names -> another layout's: transformers 5's in-memory one (with the hub's CLIP / SigLIP
# `vision_model.` prefix), and the older hub one (`language_model.model.*` with `vision_tower.vision_model.*`).
_LAYOUTS = {
    "transformers5": (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower.vision_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ),
    "hub_v4": (("vision_tower.", "vision_tower.vision_model."),),
}


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_loads_the_hub_layouts(
    arch: str, layout: str, vlm_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A checkpoint in another layout's names loads into the same parameters as the saved layout."""
    source = vlm_path(arch)
    shutil.copytree(source, tmp_path / "model")
    tensors = load_file(str(source / "model.safetensors"))
    renamed = {}
    for name, tensor in tensors.items():
        for old, new in _LAYOUTS[layout]:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        renamed[name] = tensor
    assert set(renamed) != set(tensors)
    save_file(renamed, str(tmp_path / "model" / "model.safetensors"))
    want = dict(load_model(str(source), dtype=torch.float32, device=CPU).model.named_parameters())
    got = dict(load_model(str(tmp_path / "model"), dtype=torch.float32, device=CPU).model.named_parameters())
    assert got.keys() == want.keys()
    for name, param in got.items():
        torch.testing.assert_close(param, want[name], atol=0, rtol=0, msg=name)


def test_unknown_checkpoint_tensor_is_refused(vlm_path: Callable[[str], Path], tmp_path: Path) -> None:
    """A stray tensor in a VLM checkpoint still fails the strict load (renaming hides nothing)."""
    source = vlm_path("llava")
    shutil.copytree(source, tmp_path / "model")
    tensors = load_file(str(source / "model.safetensors"))
    tensors["model.vision_tower.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model" / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=re.escape("model.vision_tower.extra.weight")):
        load_model(str(tmp_path / "model"), dtype=torch.float32, device=CPU)


def test_registry_builds_the_vlm_classes(vlm_path: Callable[[str], Path]) -> None:
    """Both architectures resolve to their classes, with the text config's KV cache."""
    for arch, cls in (
        ("llava", LlavaForConditionalGeneration),
        ("gemma3_vl", Gemma3ForConditionalGeneration),
    ):
        config = AutoConfig.from_pretrained(vlm_path(arch))
        assert model_class(config) is cls
        model = build_model(config, torch.float32, CPU)
        text = config.get_text_config()
        assert model.kv_cache_spec().num_layers == text.num_hidden_layers
        assert isinstance(model, VisionLanguageModel)
        assert model.bidirectional_images == (arch == "gemma3_vl")


# ---- processors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_processor_spans_and_tensors(arch: str, vlm_path: Callable[[str], Path]) -> None:
    """Each image's span is exactly its placeholder run (Gemma 3: soft tokens between boi and eoi), its tensors are
    its own slice of the processor's, and its content key tells the pictures apart."""
    path = vlm_path(arch)
    processor = processor_for(path, AutoConfig.from_pretrained(path))
    assert processor is not None and processor.image_marker == IMAGE_MARKERS[arch]
    text, images = _prompts(processor.image_marker)[1]
    prompt = processor.process(text, images)
    tokenizer = AutoTokenizer.from_pretrained(path)
    placeholder = "<image>" if arch == "llava" else "<image_soft_token>"
    placeholder_id = tokenizer.convert_tokens_to_ids(placeholder)
    items = prompt.multi_modal.images
    assert len(items) == 2 and [item.length for item in items] == [16, 16]
    ids = prompt.token_ids
    for item in items:
        assert set(ids[item.offset : item.end]) == {placeholder_id}
        assert ids[item.offset - 1] != placeholder_id and ids[item.end] != placeholder_id
        if arch == "gemma3_vl":
            assert tokenizer.convert_ids_to_tokens([ids[item.offset - 1], ids[item.end]]) == [
                "<start_of_image>",
                "<end_of_image>",
            ]
    assert ids.count(placeholder_id) == 32
    assert items[0].content_key != items[1].content_key
    assert items[0].content_key == content_key(images[0])
    size = 28 if arch == "llava" else 56
    whole = processor.process(text, images)
    assert all(item.tensors["pixel_values"].shape == (1, 3, size, size) for item in items)
    assert not torch.equal(items[0].tensors["pixel_values"], items[1].tensors["pixel_values"])
    assert torch.equal(whole.multi_modal.images[1].tensors["pixel_values"], items[1].tensors["pixel_values"])


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_processor_refuses_markers_and_images_that_disagree(
    arch: str, vlm_path: Callable[[str], Path]
) -> None:
    """More markers than images, or images without markers, are a ValueError naming the count."""
    path = vlm_path(arch)
    processor = processor_for(path, AutoConfig.from_pretrained(path))
    assert processor is not None
    marker = processor.image_marker
    with pytest.raises(ValueError, match="2 image marker"):
        processor.process(f"a {marker} b {marker}", [_image(30, 30, 4)])
    with pytest.raises(ValueError, match="0 image marker"):
        processor.process("no marker here", [_image(30, 30, 4)])
    text_only = processor.process("Hello world!", [])
    assert text_only.multi_modal.images == () and text_only.token_ids


def test_llava_marker_written_as_text_counts_as_an_image(vlm_path: Callable[[str], Path]) -> None:
    """Llava's placeholder is its marker: a literal "<image>" without an image is refused, not a crash."""
    path = vlm_path("llava")
    processor = processor_for(path, AutoConfig.from_pretrained(path))
    assert processor is not None
    with pytest.raises(ValueError, match="1 image marker"):
        processor.process("what does <image> mean in HTML?", [])


def test_gemma3_placeholder_written_as_text_is_refused(vlm_path: Callable[[str], Path]) -> None:
    """Gemma 3's `<image_soft_token>` typed into the prompt is a clear ValueError, with or without images."""
    path = vlm_path("gemma3_vl")
    processor = processor_for(path, AutoConfig.from_pretrained(path))
    assert processor is not None
    with pytest.raises(ValueError, match="placeholder"):
        processor.process("a <image_soft_token> b", [])
    with pytest.raises(ValueError, match="placeholder"):
        processor.process("a <image_soft_token> b <start_of_image> c", [_image(30, 30, 5)])


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_chat_template_writes_the_marker(arch: str, vlm_path: Callable[[str], Path]) -> None:
    """Image parts become the marker, text parts their text, plain string content itself."""
    tokenizer = AutoTokenizer.from_pretrained(vlm_path(arch))
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": "?"}],
        },
        {"role": "assistant", "content": "A fox."},
    ]
    # transformers annotates messages as str-valued dicts; content parts are the documented multimodal form.
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)  # type: ignore[arg-type]
    assert rendered == f"<|user|>Look: {IMAGE_MARKERS[arch]}?</s><|assistant|>A fox.</s>"


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_engine_serves_a_text_prompt_like_hf(arch: str, vlm_path: Callable[[str], Path]) -> None:
    """The whole engine (setup reads the nested text config) serves a VLM folder's text-only prompts: greedy
    tokens equal to transformers'."""
    path = vlm_path(arch)
    llm = LLM(
        str(path), block_size=4, num_kv_blocks=64, max_model_len=128, dtype="float32", kernel_backend="torch"
    )
    prompt = "Hello world! The quick"
    got = list(llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0))[0].outputs[0].token_ids)
    ids = AutoTokenizer.from_pretrained(path)(prompt, return_tensors="pt")["input_ids"]
    hf_class = HFLlava if arch == "llava" else HFGemma3
    reference = hf_class.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=5, do_sample=False)
    assert got == want[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize(("layers", "strategy"), [([-3, -1], "full"), (-1, "default"), ([1, -2], "default")])
def test_llava_feature_layers_and_strategies(
    layers: int | list[int], strategy: str, tmp_path: Path, torch_backend: KernelBackend
) -> None:
    """Several feature layers (concatenated), the class token kept ("full"), every layer built (-1): the
    features and the prompt's logits are transformers'."""
    path = make_tiny_vlm(
        "llava", tmp_path / "llava", vision_feature_layer=layers, vision_feature_select_strategy=strategy
    )
    model, reference, processor = _load("llava", path)
    prompt = processor.process(*_prompts(processor.image_marker)[1])
    assert [item.length for item in prompt.multi_modal.images] == [17 if strategy == "full" else 16] * 2
    pixels = torch.cat([item.tensors["pixel_values"] for item in prompt.multi_modal.images])
    with torch.no_grad():
        want = reference.get_image_features(pixel_values=pixels).pooler_output  # type: ignore[operator]
    for rows, expected in zip(model.encode_images(prompt.multi_modal.images), want, strict=True):
        torch.testing.assert_close(rows, expected, atol=FEATURES_ATOL, rtol=0)
    kv = PagedKV(model.kv_cache_spec(), torch_backend, num_blocks=64, block_size=4)
    got = _prefill(model, kv, [prompt], [0])
    with torch.no_grad():
        logits = reference(**_hf_inputs(reference, prompt)).logits[0].float()
    torch.testing.assert_close(got, logits, atol=LOGITS_ATOL, rtol=0)
