"""The image encoder and its cache, an engine extension (vLLM's `EncoderCacheManager` is the reference).

A request's images arrive already processed (`MultiModalInputs`: placeholder spans and pixel tensors). Before a
step runs, every image whose placeholder positions the step computes and whose embeddings are not cached yet is
encoded, in one batch across the step's requests; an image is encoded once however many chunks (or requests, by
content key) read it. Its embeddings are kept until the request has computed every position of the image, then
dropped (a request preempted by recompute drops them too, and encodes again when it runs again). The scheduler's
`EncoderBudget` admission rule caps the rows the running requests still need, which bounds this cache.

The runner asks `step_images` for the step's `StepImages`: the encoder rows of the step's placeholder positions,
the M-RoPE positions of an M-RoPE model, and, for a model whose images attend in both directions, the spans the
runner turns into bidirectional attention.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pagoda.scheduler import (
    EncoderSpan,
    RequestRejectedError,
    RequestStatus,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
)
from pagoda.server.engine.extension import Extension
from pagoda.server.engine.request_factory import NewRequest
from pagoda.server.engine.step_sampler import SampledStep
from pagoda.server.models.vision import StepImages, VisionLanguageModel
from pagoda.server.multimodal import ImageItem, MultiModalInputs
from torch import Tensor


def encoder_spans(multi_modal: MultiModalInputs, num_prompt_tokens: int, atomic: bool) -> list[EncoderSpan]:
    """The scheduler's spans of a prompt's images; RequestRejectedError (param "messages") when they are not in
    prompt order, overlap, or leave the prompt."""
    spans: list[EncoderSpan] = []
    end = 0
    for index, item in enumerate(multi_modal.images):
        if item.offset < end or item.length < 1 or item.end > num_prompt_tokens:
            raise RequestRejectedError(
                f"image {index} spans positions {item.offset}..{item.end}, outside the prompt of "
                f"{num_prompt_tokens} tokens or over another image",
                "messages",
            )
        spans.append(EncoderSpan(item.offset, item.length, item.content_key, atomic))
        end = item.end
    mrope = multi_modal.mrope_positions
    if mrope is not None and tuple(mrope.shape) != (3, num_prompt_tokens):
        raise RequestRejectedError(
            f"M-RoPE positions of shape {tuple(mrope.shape)} for a prompt of {num_prompt_tokens} tokens",
            "messages",
        )
    return spans


@dataclass(frozen=True, slots=True)
class ImageStep:
    """What the runner needs for one step's images."""

    images: StepImages
    # (chunk index in the step, first query row of the image within that chunk, image length) of every image
    # a chunk computes whole, for a model whose images attend in both directions; () otherwise.
    bidirectional: tuple[tuple[int, int, int], ...] = ()


class ImageEncoder(Extension):
    """Encodes the images a step needs (batched across its requests) and keeps their embeddings until their
    positions are computed."""

    def __init__(self, model: VisionLanguageModel, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.inputs: dict[str, MultiModalInputs] = {}  # by request id: requests with images, until done
        # Embeddings by content key ([length, hidden_size]), and the (request id, image index) that still need
        # each: a key no request needs any more is dropped.
        self.embeds: dict[int, Tensor] = {}
        self.users: dict[int, set[tuple[str, int]]] = {}
        self.num_encoded = 0  # images encoded (a repeated image is encoded once while cached)
        self.encode_seconds = 0.0  # time spent in the encoder

    # ------------------------------------------------------------------ the extension hooks

    def hold(self, new: NewRequest) -> bool:
        """Register a request's images (never holds it: images are encoded when a step needs them)."""
        if new.multi_modal is not None and new.multi_modal.images:
            self.inputs[new.request.request_id] = new.multi_modal
        elif new.multi_modal is not None and new.multi_modal.mrope_positions is not None:
            self.inputs[new.request.request_id] = new.multi_modal  # text on an M-RoPE model: its positions
        return False

    def before_execute(self, scheduled: SchedulerOutput) -> None:
        """Encode, in one batch, the images this step's chunks reach that are not cached."""
        missing: dict[int, ImageItem] = {}
        for chunk in scheduled.scheduled:
            request_id = self._owner_of(chunk.request_id)
            if request_id is None:
                continue
            for index, item in enumerate(self.inputs[request_id].images):
                if item.offset < chunk.seq_len and item.end > chunk.start:
                    self.users.setdefault(item.content_key, set()).add((chunk.request_id, index))
                    if item.content_key not in self.embeds:
                        missing.setdefault(item.content_key, item)
        if not missing:
            return
        start = time.perf_counter()
        items = list(missing.values())
        outputs = self.model.encode_images(items)
        for item, rows in zip(items, outputs, strict=True):
            if rows.shape[0] != item.length:
                raise RuntimeError(
                    f"the encoder gave {rows.shape[0]} rows for an image of {item.length} tokens"
                )
            self.embeds[item.content_key] = rows
        self.num_encoded += len(items)
        self.encode_seconds += time.perf_counter() - start

    def after_update(self, scheduler: Scheduler, sampled: SampledStep, now: float) -> None:
        """Drop the embeddings of images whose positions are all computed (or whose request left the running
        batch: preempted by recompute, it encodes them again)."""
        for key, users in list(self.users.items()):
            for user in list(users):
                seq_id, index = user
                request = scheduler.get_request(seq_id)
                owner = self._owner_of(seq_id)
                inputs = None if owner is None else self.inputs[owner]
                if (
                    request is None
                    or inputs is None
                    or request.status is not RequestStatus.RUNNING
                    or request.num_computed_tokens >= inputs.images[index].end
                ):
                    users.discard(user)
            if not users:
                del self.users[key]
                self.embeds.pop(key, None)

    def done(self, request_id: str) -> None:
        """Forget a request's images (their embeddings go once no other request needs them)."""
        if self.inputs.pop(request_id, None) is None:
            return
        for key, users in list(self.users.items()):
            # Its samples and beams too: their sequence ids extend the request id.
            users.difference_update(
                [u for u in users if u[0] == request_id or u[0].startswith(request_id + ":")]
            )
            if not users:
                del self.users[key]
                self.embeds.pop(key, None)

    def _owner_of(self, seq_id: str) -> str | None:
        """The request with images that sequence `seq_id` belongs to: itself, or the request whose id it extends
        (a sample "id:1" of n, a beam "id:beam3"); None for a request without images."""
        while True:
            if seq_id in self.inputs:
                return seq_id
            seq_id, sep, _ = seq_id.rpartition(":")
            if not sep:
                return None

    # ------------------------------------------------------------------ the runner's side

    @property
    def num_cached_tokens(self) -> int:
        """Encoder rows held now."""
        return sum(rows.shape[0] for rows in self.embeds.values())

    def step_images(self, scheduled: Sequence[ScheduledRequest]) -> ImageStep | None:
        """The step's encoder rows (and M-RoPE positions, and bidirectional spans); None when no chunk of the
        step belongs to a request with images (or M-RoPE positions)."""
        owners = [self._owner_of(chunk.request_id) for chunk in scheduled]
        if not any(owners):
            return None
        rows: list[int] = []
        pieces: list[Tensor] = []
        bidirectional: list[tuple[int, int, int]] = []
        uses_mrope = self.model.uses_mrope
        mrope: list[Tensor] = []
        offset = 0
        for index, (chunk, owner) in enumerate(zip(scheduled, owners, strict=True)):
            inputs = None if owner is None else self.inputs[owner]
            if uses_mrope:
                mrope.append(_mrope_positions(chunk, inputs))
            if inputs is not None:
                for item in inputs.images:
                    lo, hi = max(item.offset, chunk.start), min(item.end, chunk.seq_len)
                    if lo >= hi:
                        continue
                    embeds = self.embeds[item.content_key]
                    pieces.append(embeds[lo - item.offset : hi - item.offset])
                    rows.extend(range(offset + lo - chunk.start, offset + hi - chunk.start))
                    if self.model.bidirectional_images and (lo, hi) == (item.offset, item.end):
                        bidirectional.append((index, item.offset - chunk.start, item.length))
            offset += chunk.num_tokens
        dtype = next(self.model.parameters()).dtype
        embeds = (
            torch.cat(pieces).to(self.device, dtype)
            if pieces
            else torch.empty(0, 0, dtype=dtype, device=self.device)
        )
        images = StepImages(
            rows=torch.tensor(rows, dtype=torch.int64).to(self.device),
            embeds=embeds,
            mrope_positions=torch.cat(mrope, dim=1).to(self.device) if mrope else None,
        )
        return ImageStep(images, tuple(bidirectional))


def _mrope_positions(
    chunk: ScheduledRequest, inputs: MultiModalInputs | None
) -> Tensor:  # int64 [3, chunk.num_tokens]
    """A chunk's M-RoPE positions: the prompt's from its processor, a later position p as p + delta on all three
    axes (a text-only request: p on all three)."""
    positions = torch.arange(chunk.start, chunk.seq_len, dtype=torch.int64)
    if inputs is None or inputs.mrope_positions is None:
        return positions.expand(3, -1)
    prompt = inputs.mrope_positions
    prompt_len = prompt.shape[1]
    head = prompt[:, chunk.start : min(chunk.seq_len, prompt_len)]
    tail = positions[max(0, prompt_len - chunk.start) :] + inputs.mrope_delta
    return torch.cat([head, tail.expand(3, -1)], dim=1)
