"""Encoder spans (an image's placeholder tokens): the prefix cache keys them by content, a prefill chunk never ends
inside an atomic span, and the `EncoderBudget` admission rule caps the encoder rows running requests still need."""

from __future__ import annotations

from typing import Any

import pytest
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import (
    EncoderBudget,
    EncoderSpan,
    Request,
    RequestRejectedError,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    build_rules,
)
from pagoda.scheduler.testing import SimSamplingParams

BS = 4
IMAGE = 9  # the placeholder token id
TEXT = list(range(100, 108))  # two blocks of text before the image


def make(**config: Any) -> Scheduler:
    """A scheduler over a prefix-caching block pool with room for everything."""
    cfg = SchedulerConfig(**{"max_model_len": 128, "watermark": 0.0, **config})
    return Scheduler(cfg, BlockManager(256, BS, enable_prefix_caching=cfg.enable_prefix_caching))


def image_request(
    rid: str, key: int, *, length: int = 8, atomic: bool = False, max_tokens: int = 2, tail: int = 1
) -> Request:
    """Eight text tokens, an image of `length` placeholders with content key `key`, four more text tokens from
    `tail` on."""
    prompt = [*TEXT, *[IMAGE] * length, *range(tail, tail + 4)]
    span = EncoderSpan(len(TEXT), length, key, atomic)
    return Request(rid, prompt, SimSamplingParams(max_tokens=max_tokens), encoder_spans=[span])


def run(sched: Scheduler) -> list[SchedulerOutput]:
    """Step until every request finished (each sample gets token 7); the steps."""
    outs = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        tokens = {c.request_id: [7] for c in out.scheduled if c.num_samples}
        sched.update_from_output(out, tokens)
        outs.append(out)
    return outs


def test_block_keys_put_the_content_key_at_the_span() -> None:
    """The allocator hashes the key at the image's positions and the real ids elsewhere; outputs append to both;
    the chunk's input ids stay the real placeholder ids."""
    request = image_request("a", -5)
    assert list(request.block_key_ids) == [*TEXT, *[-5] * 8, 1, 2, 3, 4]
    request.append_output_token(42)
    assert request.block_key_ids[-1] == 42 and request.all_token_ids[-1] == 42
    child = request.copy_as("a:1", parent_id="a", sample_index=1)
    assert list(child.block_key_ids) == list(request.block_key_ids)
    sched = make()
    sched.add_request(image_request("b", -5))
    out = sched.schedule()
    assert list(out.scheduled[0].token_ids) == [*TEXT, *[IMAGE] * 8, 1, 2, 3, 4]


def test_a_span_outside_the_prompt_is_refused() -> None:
    """A span past the prompt's end is a malformed request."""
    with pytest.raises(RequestRejectedError, match="outside its prompt"):
        Request("x", [1, 2, 3], SimSamplingParams(max_tokens=1), encoder_spans=[EncoderSpan(2, 4, -1)])


def test_the_same_image_hits_and_another_image_does_not() -> None:
    """After one request with image key -5 ran, a second with the same key hits past the image; one with key -6
    hits only the text blocks before the image."""
    sched = make()
    sched.add_request(image_request("first", -5))
    run(sched)
    sched.add_request(image_request("same", -5))
    same = sched.schedule().scheduled[0]
    sched.abort_request("same")
    sched.add_request(image_request("other", -6))
    other = sched.schedule().scheduled[0]
    assert same.start == 16  # text (8) + image (8): four full blocks
    assert other.start == 8  # the text blocks only


@pytest.mark.parametrize("atomic", [False, True])
def test_chunks_split_an_image_only_when_it_is_not_atomic(atomic: bool) -> None:
    """With a 12-token budget, a non-atomic image is split across chunks; an atomic one is cut before (8 text
    tokens first) and then prefilled whole."""
    sched = make(max_num_batched_tokens=12, enable_chunked_prefill=True)
    sched.add_request(image_request("a", -5, atomic=atomic))
    chunks = [(c.start, c.num_tokens) for out in run(sched) for c in out.scheduled]
    if atomic:
        assert chunks[:2] == [(0, 8), (8, 12)]
    else:
        assert chunks[:2] == [(0, 12), (12, 8)]


def test_an_atomic_image_larger_than_a_step_is_refused() -> None:
    """An atomic image of 16 tokens can never fit a 12-token step: refused at once, naming the messages."""
    sched = make(max_num_batched_tokens=12, enable_chunked_prefill=True)
    with pytest.raises(RequestRejectedError) as info:
        sched.add_request(image_request("a", -5, length=16, atomic=True))
    assert info.value.param == "messages"


def test_a_cache_hit_inside_an_atomic_span_resumes_to_its_end() -> None:
    """A prefix hit that ends inside an atomic image (same content: its KV is the same) resumes there, and the
    next chunk runs to the image's end at least (the image spans 8..18; the text after it differs)."""
    sched = make(max_num_batched_tokens=12, enable_chunked_prefill=True)
    sched.add_request(image_request("first", -5, length=10, atomic=True))
    run(sched)
    sched.add_request(image_request("again", -5, length=10, atomic=True, tail=50))
    chunk = sched.schedule().scheduled[0]
    assert chunk.start == 16 and chunk.start + chunk.num_tokens >= 18


def test_encoder_budget_holds_images_beyond_it() -> None:
    """Budget 12: two 8-token images do not run together; a text request passes the held one; the second image
    runs once the first was prefilled."""
    sched = make(encoder_cache_tokens=12)
    assert any(isinstance(rule, EncoderBudget) for rule in build_rules(sched.config))
    sched.add_request(image_request("a", -5, max_tokens=4))
    sched.add_request(image_request("b", -6, max_tokens=4))
    sched.add_request(Request("text", [1, 2, 3], SimSamplingParams(max_tokens=2)))
    first = {c.request_id for c in sched.schedule().scheduled}
    assert first == {"a", "text"}


def test_encoder_budget_lets_a_large_image_run_alone() -> None:
    """An image larger than the budget runs when no other image is pending (else it would wait forever)."""
    rule = EncoderBudget(4)
    big = image_request("big", -5)
    assert rule.fits(big, [])
    other = image_request("other", -6)
    assert not rule.fits(big, [other])
    other.num_computed_tokens = other.chunk_start = 16  # its image was prefilled in an earlier step
    assert rule.fits(big, [other])
    with pytest.raises(ValueError, match="max_tokens"):
        EncoderBudget(0)
