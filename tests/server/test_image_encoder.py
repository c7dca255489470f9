"""The engine's image path without a real vision model: the wire form of a prompt's images, the spans the engine
checks, the encoder cache (one encode per image, batched, shared by content, dropped once computed) and the rows
and M-RoPE positions it hands the runner."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest
import torch
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import Request, RequestRejectedError, Scheduler, SchedulerConfig, SchedulerOutput
from pagoda.scheduler.testing import SimSamplingParams
from pagoda.server.engine.images import ImageEncoder, encoder_spans
from pagoda.server.engine.request_factory import NewRequest
from pagoda.server.engine.sample_failures import SampleFailures
from pagoda.server.engine.step_sampler import SampledStep
from pagoda.server.models.attention import AttentionMetadata, LayerKVCache
from pagoda.server.models.base import KVCacheSpec
from pagoda.server.models.vision import StepImages, VisionLanguageModel
from pagoda.server.multimodal import ImageItem, MultiModalInputs, content_key
from pagoda.server.multimodal.inputs import block_keys
from pagoda.server.multimodal.wire import WireMultiModal, WireTensor
from PIL import Image
from torch import Tensor

HIDDEN = 4
IMAGE = 9


class CountingVLM(VisionLanguageModel):
    """A stand-in model: an image's rows are its pixel value repeated; every encode call is recorded."""

    def __init__(self, *, bidirectional: bool = False, mrope: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.calls: list[list[int]] = []  # content keys per encode call
        self.bidirectional_images = bidirectional  # type: ignore[misc]
        self.uses_mrope = mrope  # type: ignore[misc]

    def encode_images(self, images: Sequence[ImageItem]) -> list[Tensor]:
        """[length, HIDDEN] rows of the image's pixel value."""
        self.calls.append([item.content_key for item in images])
        return [item.tensors["pixel_values"].reshape(1, 1).expand(item.length, HIDDEN) for item in images]

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: Sequence[LayerKVCache],
        attn: AttentionMetadata,
        images: StepImages | None = None,
    ) -> Tensor:
        """Not run here."""
        raise AssertionError("not run")

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Not run here."""
        raise AssertionError("not run")

    def kv_cache_spec(self) -> KVCacheSpec:
        """Not used here."""
        return KVCacheSpec(1, 1, 1)


def image(offset: int, length: int, value: float) -> ImageItem:
    """An image whose content key and pixels both derive from `value`."""
    return ImageItem(offset, length, -1 - int(value), {"pixel_values": torch.tensor([value])})


def empty_step() -> SampledStep:
    """A step that drew nothing."""
    return SampledStep((), (), SampleFailures())


def test_wire_round_trip_is_exact() -> None:
    """Images (float, bfloat16 and int64 tensors) and M-RoPE positions come back equal through msgpack."""
    inputs = MultiModalInputs(
        (
            ImageItem(2, 3, -7, {"pixel_values": torch.randn(1, 3, 5, 5), "grid": torch.tensor([[1, 2, 2]])}),
            ImageItem(9, 1, -8, {"pixel_values": torch.randn(2, 2).to(torch.bfloat16)}),
        ),
        torch.arange(36).reshape(3, 12),
        -4,
    )
    frame = msgspec.msgpack.decode(msgspec.msgpack.encode(WireMultiModal.of(inputs)), type=WireMultiModal)
    back = frame.inputs()
    assert back.mrope_delta == -4 and torch.equal(back.mrope_positions, inputs.mrope_positions)  # type: ignore[arg-type]
    for got, want in zip(back.images, inputs.images, strict=True):
        assert (got.offset, got.length, got.content_key) == (want.offset, want.length, want.content_key)
        assert got.tensors.keys() == want.tensors.keys()
        for name, tensor in want.tensors.items():
            assert got.tensors[name].dtype == tensor.dtype and torch.equal(got.tensors[name], tensor)


def test_wire_refuses_inconsistent_tensors() -> None:
    """A frame whose bytes do not match its shape, or with an unknown dtype, is refused (never reshaped)."""
    with pytest.raises(ValueError, match="bytes"):
        WireTensor("float32", [2, 2], b"\0" * 12).tensor()
    with pytest.raises(ValueError, match="dtype"):
        WireTensor("complex64", [1], b"\0" * 8).tensor()
    with pytest.raises(ValueError, match="cannot go on the wire"):
        WireTensor.of(torch.zeros(2, dtype=torch.int8))


def test_content_key_follows_the_pixels() -> None:
    """The same pixels in another container give the same key; one changed pixel another; keys are negative."""
    a = Image.new("RGB", (8, 8), (10, 20, 30))
    b = a.copy()
    assert content_key(a) == content_key(b) < 0
    b.putpixel((3, 3), (10, 20, 31))
    assert content_key(a) != content_key(b)


def test_encoder_spans_are_checked() -> None:
    """Spans out of order, overlapping or past the prompt, and M-RoPE positions of the wrong shape, are refused
    naming the messages."""
    good = MultiModalInputs((image(1, 2, 1.0), image(4, 2, 2.0)))
    spans = encoder_spans(good, 8, atomic=True)
    assert [(s.offset, s.length, s.atomic) for s in spans] == [(1, 2, True), (4, 2, True)]
    for bad in (
        MultiModalInputs((image(4, 2, 1.0), image(1, 2, 2.0))),
        MultiModalInputs((image(1, 3, 1.0), image(3, 2, 2.0))),
        MultiModalInputs((image(7, 2, 1.0),)),
        MultiModalInputs((image(1, 2, 1.0),), torch.zeros(3, 5, dtype=torch.int64)),
    ):
        with pytest.raises(RequestRejectedError) as info:
            encoder_spans(bad, 8, atomic=False)
        assert info.value.param == "messages"


def _engine_side(
    model: CountingVLM, requests: Sequence[tuple[str, MultiModalInputs, int]], **config: int
) -> tuple[Scheduler, ImageEncoder]:
    """A scheduler and encoder holding `requests` (id, images, prompt length; the placeholders are IMAGE)."""
    cfg = SchedulerConfig(max_model_len=64, watermark=0.0, **config)  # type: ignore[arg-type]
    sched = Scheduler(cfg, BlockManager(64, 4))
    encoder = ImageEncoder(model, torch.device("cpu"))
    for rid, inputs, length in requests:
        spans = encoder_spans(inputs, length, model.bidirectional_images)
        request = Request(rid, [IMAGE] * length, SimSamplingParams(max_tokens=2), encoder_spans=spans)
        assert not encoder.hold(NewRequest(None, request, None, multi_modal=inputs))  # type: ignore[arg-type]
        sched.add_request(request)
    return sched, encoder


def _run_step(sched: Scheduler, encoder: ImageEncoder) -> tuple[SchedulerOutput, StepImages | None]:
    """Schedule, encode, hand the runner its rows, update (token 1 for each sample)."""
    out = sched.schedule()
    encoder.before_execute(out)
    step = encoder.step_images(out.scheduled)
    sched.update_from_output(out, {c.request_id: [1] for c in out.scheduled if c.num_samples})
    encoder.after_update(sched, empty_step(), 0.0)
    return out, None if step is None else step.images


def test_one_batched_encode_per_image_shared_by_content() -> None:
    """Three requests, two of them with the same picture: one encode call of two images; the rows reach the
    runner at the placeholder rows (c's image is a prefix-cache hit on a's first block: it needs none); the
    cache is empty once the prompts are computed."""
    model = CountingVLM()
    sched, encoder = _engine_side(
        model,
        [
            ("a", MultiModalInputs((image(1, 2, 5.0),)), 4),
            ("b", MultiModalInputs((image(0, 3, 6.0),)), 4),
            ("c", MultiModalInputs((image(1, 2, 5.0),)), 5),
        ],
    )
    out, images = _run_step(sched, encoder)
    assert [sorted(call) for call in model.calls] == [[-7, -6]]
    assert images is not None
    assert [(c.request_id, c.start) for c in out.scheduled] == [("a", 0), ("b", 0), ("c", 4)]
    assert images.rows.tolist() == [1, 2, 4, 5, 6]  # a: rows 0-3, b: 4-7, c: 8
    assert images.embeds[:, 0].tolist() == [5.0, 5.0, 6.0, 6.0, 6.0]
    assert encoder.num_cached_tokens == 0 and not encoder.users
    while sched.has_unfinished_requests():  # decodes need no rows
        _, images = _run_step(sched, encoder)
        assert images is not None and images.rows.numel() == 0
    for rid in "abc":
        encoder.done(rid)
    assert not encoder.inputs and len(model.calls) == 1


def test_embeddings_stay_cached_across_chunks_and_go_once_computed() -> None:
    """A 6-token image split over chunks of 4 is encoded once and read twice, then dropped."""
    model = CountingVLM()
    sched, encoder = _engine_side(
        model,
        [("a", MultiModalInputs((image(1, 6, 3.0),)), 8)],
        max_num_batched_tokens=4,
        enable_chunked_prefill=True,
    )
    _, first = _run_step(sched, encoder)
    assert first is not None and first.rows.tolist() == [1, 2, 3]
    assert encoder.num_cached_tokens == 6
    _, second = _run_step(sched, encoder)
    assert second is not None and second.rows.tolist() == [0, 1, 2]
    assert len(model.calls) == 1 and encoder.num_cached_tokens == 0


def test_bidirectional_images_are_reported_whole() -> None:
    """A model whose images attend both ways gets (chunk, first row, length) of each image in the step."""
    model = CountingVLM(bidirectional=True)
    sched, encoder = _engine_side(
        model,
        [("a", MultiModalInputs((image(2, 3, 1.0),)), 6), ("b", MultiModalInputs((image(0, 2, 2.0),)), 3)],
    )
    out = sched.schedule()
    encoder.before_execute(out)
    step = encoder.step_images(out.scheduled)
    assert step is not None and step.bidirectional == ((0, 2, 3), (1, 0, 2))


def test_mrope_positions_prompt_then_delta() -> None:
    """An M-RoPE model's step positions: the prompt's from its processor, later positions p + delta, and a
    text-only request's p on all three axes."""
    model = CountingVLM(mrope=True)
    prompt_positions = torch.tensor([[0, 1, 1, 1, 3], [0, 1, 1, 2, 3], [0, 1, 2, 1, 3]])
    inputs = MultiModalInputs((image(1, 3, 1.0),), prompt_positions, -1)
    sched, encoder = _engine_side(model, [("a", inputs, 5)])
    sched.add_request(Request("t", [1, 2], SimSamplingParams(max_tokens=2)))
    _, first = _run_step(sched, encoder)
    assert first is not None and first.mrope_positions is not None
    assert first.mrope_positions.tolist() == [
        [0, 1, 1, 1, 3, 0, 1],
        [0, 1, 1, 2, 3, 0, 1],
        [0, 1, 2, 1, 3, 0, 1],
    ]
    _, second = _run_step(sched, encoder)
    assert second is not None and second.mrope_positions is not None
    assert second.mrope_positions.tolist() == [[4, 2], [4, 2], [4, 2]]  # a: 5 - 1; t: 2


def test_a_preempted_request_encodes_again() -> None:
    """Embeddings are dropped when their request leaves the running batch before its image was computed."""
    model = CountingVLM()
    sched, encoder = _engine_side(
        model,
        [("a", MultiModalInputs((image(1, 6, 3.0),)), 8)],
        max_num_batched_tokens=4,
        enable_chunked_prefill=True,
    )
    _run_step(sched, encoder)
    assert encoder.num_cached_tokens == 6
    request = sched.get_request("a")
    assert request is not None
    sched.running.remove(request)  # as a preemption by recompute leaves it: waiting, nothing computed
    request.num_computed_tokens = 0
    request.status = request.status.PREEMPTED
    encoder.after_update(sched, empty_step(), 0.0)
    assert encoder.num_cached_tokens == 0


def test_router_keys_match_the_schedulers() -> None:
    """The keys a router matches a prompt by are the block keys its scheduler request hashes."""
    inputs = MultiModalInputs((image(1, 2, 1.0), image(5, 1, 2.0)))
    ids = [3, IMAGE, IMAGE, 4, 5, IMAGE, 6]
    request = Request(
        "r", ids, SimSamplingParams(max_tokens=1), encoder_spans=encoder_spans(inputs, 7, False)
    )
    assert block_keys(ids, inputs) == list(request.block_key_ids) == [3, -2, -2, 4, 5, -3, 6]
    assert block_keys(ids, None) == ids
