"""Turns a SchedulerOutput into flat varlen tensors, moves KV blocks, runs the model, returns sampled-row logits."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from pagoda.pagedkernel import KernelBackend
from pagoda.pagedkernel.sampling import SampleOutput, SamplingTensors, get_sampler
from pagoda.scheduler import ScheduledRequest, SchedulerOutput
from pagoda.server.engine.kv_cache import KVCache
from pagoda.server.models.attention import Attention, AttentionMetadata, LayerKVCache
from pagoda.server.models.base import CausalLM, DecoderLM
from pagoda.server.models.fused_head import FusedHead
from pagoda.server.models.image_attention import bidirectional_metadata
from pagoda.server.models.vision import StepImages
from torch import Tensor


@dataclass(frozen=True, slots=True)
class PreparedBatch:
    """The model's inputs for one step: every scheduled token of every request, concatenated."""

    input_ids: Tensor  # int64 [num_tokens]
    positions: Tensor  # int64 [num_tokens]
    attn: AttentionMetadata
    logits_indices: Tensor  # int64 [num_sampled_chunks]: the last token row of each chunk that samples
    num_samples: Tensor  # int64 [num_sampled_chunks]: samples drawn from that row (n when a prompt forks)
    num_rows: int  # the sum of num_samples: logits rows the sampler draws from


@dataclass(frozen=True, slots=True)
class PromptHidden:
    """The final hidden states of the chunk positions a request asked for (prompt logprobs, pooling)."""

    start: int  # position of the first row
    hidden: Tensor  # [num_positions, hidden_size]: positions start, start + 1, ...


class ImageSource(Protocol):
    """Where a vision-language model's runner gets the step's encoder rows (`engine.images.ImageEncoder`)."""

    def step_images(self, scheduled: Sequence[ScheduledRequest]) -> ImageStepLike | None:
        """The step's images; None when none of its chunks has any."""
        ...


class ImageStepLike(Protocol):
    """One step's images: the model's `StepImages`, and the images the runner makes bidirectional."""

    @property
    def images(self) -> StepImages:
        """The encoder rows (and M-RoPE positions) the model takes."""
        ...

    @property
    def bidirectional(self) -> tuple[tuple[int, int, int], ...]:
        """(chunk index, first query row in the chunk, length) of each image attended in both directions."""
        ...


class StepForward(Protocol):
    """The forward pass of a text step: the model itself, or attention/FFN disaggregation's layer-by-layer
    exchange with its FFN rank (engine/executor/afd_model.py)."""

    def __call__(
        self,
        input_ids: Tensor,  # int64 [num_tokens]
        positions: Tensor,  # int64 [num_tokens]
        kv_caches: Sequence[LayerKVCache],  # one per layer
        attn: AttentionMetadata,
    ) -> Tensor:  # [num_tokens, hidden_size]
        """The final hidden state of every token, writing the tokens' K/V into the caches."""
        ...


class RunnerHook(Protocol):
    """Model-side work around each forward pass that every tensor-parallel rank does (the LoRA slots)."""

    def prepare(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Before the forward pass: set up what the model's layers read for this step's chunks."""
        ...

    def select_head_rows(
        self,
        logits_indices: Tensor
        | None,  # int64 [num_logits_rows]: the token rows the LM head scores; None: none
    ) -> None:
        """Around the LM head: the rows it scores next (None after it, for the prompt-logprob slices)."""
        ...


def prompt_rows(chunk: ScheduledRequest, end: int) -> range:
    """Positions of a chunk before `end` (prompt logprobs: prompt length - 1, as the last prompt position predicts
    the first output; pooling: the prompt length)."""
    return range(chunk.start, max(chunk.start, min(chunk.seq_len, end)))


class ModelRunner:
    """Owns the model and its KV cache tensors; `execute` performs one scheduled step."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        backend: KernelBackend,
        device: torch.device,
        hooks: Sequence[RunnerHook] = (),
    ) -> None:
        self.model = model
        self.hooks = tuple(hooks)
        self.images: ImageSource | None = None  # a vision-language model's encoder rows (set by the engine)
        self.forward: StepForward = (
            model  # a text step's forward pass (replaced by attention/FFN disaggregation)
        )
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        layout = kv_cache.shape.layout
        if layout is not None:
            # Each attention layer reads and writes through its KV cache group's block tables.
            layers = [m for m in model.modules() if isinstance(m, Attention)]
            if len(layers) != layout.num_layers:
                raise ValueError(
                    f"KV cache layout of {layout.num_layers} layers for a model of {len(layers)}"
                )
            for layer, group in zip(layers, layout.layer_groups, strict=True):
                layer.kv_cache_group = group

    def prepare(self, scheduled: Sequence[ScheduledRequest]) -> PreparedBatch:
        """Flatten the scheduled chunks into the model's varlen inputs and attention metadata."""
        input_ids = list(itertools.chain.from_iterable(c.token_ids for c in scheduled))
        positions = list(itertools.chain.from_iterable(range(c.start, c.seq_len) for c in scheduled))
        slots = list(itertools.chain.from_iterable(c.slots for c in scheduled))
        query_start_loc = [0, *itertools.accumulate(c.num_tokens for c in scheduled)]
        width = max(len(c.block_table) for c in scheduled)
        block_tables = [[*c.block_table, *([0] * (width - len(c.block_table)))] for c in scheduled]
        # Each request's samples come from its chunk's last token; mid-prompt chunks sample nothing. A chunk
        # with k draft tokens is verified at all of its k + 1 positions (one row each).
        sampling = [
            (row, 1 if c.spec_token_ids else c.num_samples)
            for c, end in zip(scheduled, query_start_loc[1:], strict=True)
            if c.num_samples
            for row in range(end - 1 - len(c.spec_token_ids), end)
        ]

        # On CUDA the host copies are pinned, so that non_blocking uploads really are asynchronous (a copy from
        # pageable memory is staged and waits); torch's caching host allocator keeps a pinned buffer alive until
        # its copy ran. On the CPU `.to` returns the tensor itself and pinning would only cost time.
        pin = self.device.type == "cuda"

        def tensors(dtype: torch.dtype, *values: Sequence[int]) -> tuple[Tensor, ...]:
            """`values` as 1-D tensors: views of one tensor built (and uploaded) once. A tensor costs several
            microseconds to build, and a decode step's Python runs with caches the weights' stream left cold."""
            flat = torch.tensor(list(itertools.chain.from_iterable(values)), dtype=dtype, pin_memory=pin)
            return torch.split(flat.to(self.device, non_blocking=True), [len(v) for v in values])

        # Padding with block 0 (the null block): past a sequence's end, never read.
        group_tables = [
            [[*t, *([0] * (width - len(t)))] for t in (c.group_block_tables[g] for c in scheduled)]
            for g in range(len(scheduled[0].group_block_tables))
        ]
        num_groups = len(group_tables)
        num_seqs = len(scheduled)
        slot_mapping, ids, pos, logits_indices, num_samples, *group_slots = tensors(
            torch.int64,
            slots,
            input_ids,
            positions,
            [row for row, _ in sampling],
            [n for _, n in sampling],
            *(
                list(itertools.chain.from_iterable(c.group_slots[g] for c in scheduled))
                for g in range(num_groups)
            ),
        )
        tables, context_lens, starts, *flat_group_tables = tensors(
            torch.int32,
            list(itertools.chain.from_iterable(block_tables)),
            [c.seq_len for c in scheduled],
            query_start_loc,
            *(list(itertools.chain.from_iterable(t)) for t in group_tables),
        )
        attn = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=tables.view(num_seqs, width),
            context_lens=context_lens,
            query_start_loc=starts,
            max_query_len=max(c.num_tokens for c in scheduled),
            is_decode=all(c.num_tokens == 1 for c in scheduled),
            backend=self.backend,
            group_slot_mappings=tuple(group_slots),
            group_block_tables=tuple(t.view(num_seqs, width) for t in flat_group_tables),
        )
        return PreparedBatch(
            input_ids=ids,
            positions=pos,
            attn=attn,
            logits_indices=logits_indices,
            num_samples=num_samples,
            num_rows=sum(n for _, n in sampling),
        )

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:  # [num_rows, vocab] from [num_rows, hidden_size]
        """The LM head on some final hidden states (prompt logprobs, computed a slice at a time)."""
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(
        self,
        output: SchedulerOutput,
        # Request id -> end of the positions whose hidden states it wants (prompt logprobs, pooling; empty: none).
        prompt_lens: Mapping[str, int],
    ) -> tuple[Tensor, dict[str, PromptHidden]]:  # ([num_rows, vocab], request id -> its chunk's prompt rows)
        """Swap out, swap in, copy-on-write, then the forward pass: the logits of the rows to sample, in order
        (see CausalLM.compute_logits), and the hidden states of the prompt positions of the listed requests.

        Only hidden states come back (hidden_size wide, not vocab wide): the caller runs the LM head over them a
        slice at a time, so a long prompt never holds [prompt_len, vocab] logits at once.
        """
        ran = self._forward(output, prompt_lens)
        if ran is None:
            return torch.empty(0, 0), {}
        batch, hidden, prompt_hidden = ran
        if batch.logits_indices.numel() == 0:
            return torch.empty(0, 0), prompt_hidden
        if not self.model.computes_logits:  # the pooling runner: its held rows are never read
            return hidden.new_empty(batch.num_rows, 0), prompt_hidden
        for hook in self.hooks:
            hook.select_head_rows(batch.logits_indices)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        for hook in self.hooks:
            hook.select_head_rows(None)
        # The count prepare() knew: reading it back from the device tensor would wait for the GPU every step.
        if logits.shape[0] == batch.num_rows:
            return logits, prompt_hidden
        # A prompt that forks into n samples: its logits row is computed once and drawn from n times (output_size
        # spares repeat_interleave the device sync it would need to size its result).
        return logits.repeat_interleave(batch.num_samples, dim=0, output_size=batch.num_rows), prompt_hidden

    @torch.inference_mode()
    def execute_sampled(
        self,
        output: SchedulerOutput,
        prompt_lens: Mapping[str, int],
        draw: SamplingTensors,  # one row per sample id of the step, in schedule order; only tokens wanted
    ) -> tuple[SampleOutput, dict[str, PromptHidden]] | None:
        """`execute` with the rows' tokens drawn straight from the LM head (the model's `fused_head`: bitwise the
        tokens the sampler would draw from `execute`'s logits); None, before anything ran, when the model or the
        step is not one it draws (the caller then runs `execute`)."""
        model = self.model
        if not isinstance(model, DecoderLM) or self.hooks or not output.scheduled:
            return None
        head = getattr(model, "fused_head", None)  # set by the models that have one
        rows = int(draw.keys.shape[0])
        if not isinstance(head, FusedHead) or not head.applies(model, draw):
            return None
        ran = self._forward(output, prompt_lens)
        assert ran is not None
        batch, hidden, prompt_hidden = ran
        picked = hidden[batch.logits_indices]
        if picked.shape[0] != rows:  # a prompt forking into n samples: n draws from its one row
            picked = picked.repeat_interleave(batch.num_samples, dim=0, output_size=rows)
        out = head.draw(model, picked, draw)
        if out is None:  # hidden states of a dtype it does not read: the logits, drawn by the specification
            out = get_sampler("torch")(model.compute_logits(picked), draw)
        return out, prompt_hidden

    def _forward(
        self, output: SchedulerOutput, prompt_lens: Mapping[str, int]
    ) -> tuple[PreparedBatch, Tensor, dict[str, PromptHidden]] | None:  # None: nothing scheduled
        """The cache moves and the forward pass: the batch, its final hidden states [num_tokens, hidden_size] and
        the prompt rows of the listed requests."""
        self.kv_cache.swap_out(output.blocks_to_swap_out)
        self.kv_cache.swap_in(output.blocks_to_swap_in)
        self.kv_cache.copy(output.blocks_to_copy)
        if not output.scheduled:
            return None
        batch = self.prepare(output.scheduled)
        for hook in self.hooks:
            hook.prepare(output.scheduled)
        step = None if self.images is None else self.images.step_images(output.scheduled)
        if step is None:
            hidden = self.forward(batch.input_ids, batch.positions, self.kv_cache.layer_caches, batch.attn)
        else:
            attn = batch.attn
            if step.bidirectional:
                attn = bidirectional_metadata(attn, step.bidirectional)
            caches = self.kv_cache.layer_caches
            hidden = self.model(batch.input_ids, batch.positions, caches, attn, images=step.images)
        prompt_hidden: dict[str, PromptHidden] = {}
        offset = 0
        for chunk in output.scheduled:
            end = prompt_lens.get(chunk.request_id)
            rows = prompt_rows(chunk, end) if end is not None else range(0)
            if rows:
                first = offset + rows.start - chunk.start
                prompt_hidden[chunk.request_id] = PromptHidden(rows.start, hidden[first : first + len(rows)])
            offset += chunk.num_tokens
        return batch, hidden, prompt_hidden
