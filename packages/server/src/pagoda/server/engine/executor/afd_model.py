"""Attention/FFN disaggregation's model side: the attention ranks' forward pass and the FFN ranks' loop.

Every decoder layer of the Llama family and Gemma 3 splits at its MLP: `attend` (norm, attention, residual add and
the MLP's input norm) runs on the attention ranks, which hold the KV cache (each its shard of the heads when there
are several, o_proj all-reduced among them); the MLP runs on the FFN ranks, which hold every layer's MLP weights
(each its shard when there are several); `finish` (the residual add, Gemma's post-FFN norm) runs on the attention
ranks again. Per layer attention rank 0 sends the MLP input ([tokens, hidden]) and every attention rank receives
the MLP output. LoRA's hooks split the same way (`attention_side`, `ffn_side`).

Ping-pong (MegaScale-Infer, Step-3's AFD): a batch of two or more sequences is cut into two micro-batches of
about equal tokens; micro-batch 1's attention runs while the FFN rank computes micro-batch 0's MLP, and
micro-batch 0's next attention while it computes micro-batch 1's. Every op is row-wise or per sequence, so
the tokens are the plain engine's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
from pagoda.scheduler import ScheduledRequest
from pagoda.server.afd_config import FLAG, AttentionFFNConfig
from pagoda.server.engine.executor.comm import ProcessGroupCollectives, Work
from pagoda.server.lora.manager import LoRAManager, LoRARows
from pagoda.server.lora.request import AdapterRun
from pagoda.server.models.attention import AttentionMetadata, LayerKVCache
from pagoda.server.models.base import CausalLM
from pagoda.server.models.gemma3 import Gemma3ForCausalLM
from pagoda.server.models.llama import LlamaForCausalLM
from pagoda.server.models.parallel import TensorParallelError, check_tensor_parallel
from pagoda.server.models.registry import UnsupportedArchitectureError, model_class
from torch import Tensor, nn
from transformers import PretrainedConfig


@dataclass(frozen=True, slots=True)
class AFDRanks:
    """The ranks of an AFD world: 0..A-1 attention (0 is the driver), A..A+F-1 FFN."""

    attention: int  # A: attention ranks, tensor-parallel among themselves
    ffn: int  # F: FFN ranks, tensor-parallel among themselves

    @property
    def first_ffn(self) -> int:
        """The FFN rank that sends the MLP outputs back (to every attention rank)."""
        return self.attention

    @property
    def size(self) -> int:
        """Every rank of the world."""
        return self.attention + self.ffn

    def ffn_ranks(self) -> range:
        """The FFN ranks, in order: attention rank 0 sends each of them every MLP input."""
        return range(self.attention, self.size)

    @classmethod
    def of(cls, config: AttentionFFNConfig) -> AFDRanks:
        """The ranks `--attention-ffn-disaggregation` asks for."""
        return cls(config.attention_workers, config.ffn_workers)


# The store prefixes of the attention ranks' group (their shards' all-reduces, the logits' gather) and of the FFN
# ranks' (the MLPs' down projection), beside the world's (the activations, point to point).
ATTENTION_GROUP_PREFIX = "pagoda-afd-attention"
FFN_GROUP_PREFIX = "pagoda-afd-ffn"


class SplitLayer(Protocol):
    """A decoder layer run in two halves around its MLP."""

    mlp: nn.Module

    def attend(
        self,
        x: Tensor,  # [num_tokens, hidden]
        cos: Tensor,  # [num_tokens, 1, head_dim // 2]
        sin: Tensor,  # [num_tokens, 1, head_dim // 2]
        kv_cache: LayerKVCache,
        attn: AttentionMetadata,
    ) -> tuple[Tensor, Tensor]:  # ([num_tokens, hidden] residual, [num_tokens, hidden] the MLP's input)
        """Up to the MLP."""
        ...

    def finish(
        self,
        residual: Tensor,  # [num_tokens, hidden]
        mlp_out: Tensor,  # [num_tokens, hidden]
    ) -> Tensor:  # [num_tokens, hidden]
        """After the MLP."""
        ...


class SplitModel(Protocol):
    """A decoder LM whose layers split around their MLPs (`LlamaForCausalLM`, `Gemma3ForCausalLM`)."""

    def layer_inputs(
        self,
        input_ids: Tensor,  # int64 [num_tokens]
        positions: Tensor,  # int64 [num_tokens]
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:  # [num_tokens, hidden], each layer's cos and sin
        """The first layer's input and each layer's rotary angles."""
        ...


class UnsupportedModelError(ValueError):
    """The model's layers do not split around their MLPs here (only the Llama family and Gemma 3 text do)."""


# Exact types: a vision-language model or a classifier built on these decoders is not split (yet).
_SPLIT_CLASSES: tuple[type[CausalLM], ...] = (LlamaForCausalLM, Gemma3ForCausalLM)


def _unsupported(cls: type[CausalLM]) -> UnsupportedModelError:
    """The refusal of a model class whose layers do not split here."""
    return UnsupportedModelError(f"{FLAG} runs the Llama family and Gemma 3 text models, not {cls.__name__}")


def split_model(model: CausalLM) -> tuple[SplitModel, list[SplitLayer], nn.Module]:
    """The model as attention/FFN disaggregation runs it: itself, its layers, its final norm; refuses others."""
    if type(model) not in _SPLIT_CLASSES:
        raise _unsupported(type(model))
    inner = model.get_submodule("model")
    layers = cast(list[SplitLayer], list(cast(nn.ModuleList, inner.get_submodule("layers"))))
    return cast(SplitModel, model), layers, inner.get_submodule("norm")


def check_model(hf_config: PretrainedConfig, afd: AttentionFFNConfig) -> None:
    """ValueError naming the flag when a model's config (before any weight loads) shows that its layers do not
    split around their MLPs here, or that its heads or MLP width do not split over the asked workers."""
    try:
        cls = model_class(hf_config)
    except UnsupportedArchitectureError:
        return  # not a model of this engine at all: the load refuses it as it does without the flag
    if cls not in _SPLIT_CLASSES:
        raise _unsupported(cls)
    text = hf_config.get_text_config()
    # Both sides load tensor-parallel shards among themselves (then keep their halves of every layer).
    for key, count in (("attention_workers", afd.attention_workers), ("ffn_workers", afd.ffn_workers)):
        try:
            check_tensor_parallel(text, count, name=f"{FLAG} {key}", hint=f"choose {key} that divides it")
        except TensorParallelError as exc:
            raise ValueError(str(exc)) from None


class RemoteMLP(nn.Module):
    """Where an attention rank's layer had its MLP: the weights live on the FFN rank only."""

    def forward(self, x: Tensor) -> Tensor:  # [num_tokens, hidden]
        """Refuse: this rank holds no MLP weights; the split forward sends the MLP input to the FFN rank."""
        raise RuntimeError("this layer's MLP lives on the FFN rank (attention/FFN disaggregation)")


def mlp_names(model: nn.Module, layers: Sequence[SplitLayer]) -> tuple[str, ...]:
    """The module names of the layers' MLPs ("model.layers.0.mlp", ...): LoRA's hooks under them run on the FFN
    ranks, the others on the attention ranks."""
    mlps = {id(layer.mlp) for layer in layers}
    return tuple(name for name, module in model.named_modules() if id(module) in mlps)


def under(names: Sequence[str]) -> Callable[[str], bool]:
    """Whether a module name lies under one of `names`."""
    prefixes = tuple(f"{name}." for name in names)
    return lambda module: module.startswith(prefixes)


def attention_side(model: CausalLM, lora: LoRAManager | None) -> None:
    """An attention rank's model: its adapters apply outside the MLPs only (the FFN ranks apply the MLPs' parts),
    and its MLP weights are freed. LoRA's targets were found with the MLPs there, so an adapter of an MLP
    projection is checked and read whole."""
    _, layers, _ = split_model(model)
    if lora is not None:
        in_mlp = under(mlp_names(model, layers))
        lora.keep_hooks(lambda name: not in_mlp(name))
    drop_mlps(layers)


def ffn_side(model: CausalLM, lora: LoRAManager | None) -> nn.ModuleList:
    """An FFN rank's part of its loaded shard: every layer's MLP, its adapters applied to the MLPs only."""
    _, layers, _ = split_model(model)
    if lora is not None:
        lora.keep_hooks(under(mlp_names(model, layers)))
    return keep_mlps(layers)


def drop_mlps(layers: Sequence[SplitLayer]) -> None:
    """Free the attention rank's MLP weights."""
    for layer in layers:
        layer.mlp = RemoteMLP()


def keep_mlps(layers: Sequence[SplitLayer]) -> nn.ModuleList:
    """The FFN rank's part of a loaded model: every layer's MLP, in order (the rest is dropped with the model)."""
    return nn.ModuleList(layer.mlp for layer in layers)


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch of a step: its token rows of the flat batch and its own attention metadata."""

    start: int  # first token row
    end: int  # one past its last token row
    attn: AttentionMetadata


def micro_batches(attn: AttentionMetadata, ping_pong: bool) -> list[MicroBatch]:
    """The step as two micro-batches of whole sequences and about equal tokens (with `ping_pong` and two or more
    sequences), else as one."""
    starts = [int(n) for n in attn.query_start_loc.tolist()]  # host copy (a device sync on CUDA, once a step)
    total, num_seqs = starts[-1], len(starts) - 1
    if not ping_pong or num_seqs < 2:
        return [MicroBatch(0, total, attn)]
    cut = min(range(1, num_seqs), key=lambda k: abs(2 * starts[k] - total))
    return [_sequences(attn, starts, 0, cut), _sequences(attn, starts, cut, num_seqs)]


def _sequences(attn: AttentionMetadata, starts: list[int], first: int, last: int) -> MicroBatch:
    """The metadata of sequences [first, last) of a step, as if they were a step of their own."""
    begin, end = starts[first], starts[last]
    return MicroBatch(
        begin,
        end,
        dataclasses.replace(
            attn,
            slot_mapping=attn.slot_mapping[begin:end],
            block_tables=attn.block_tables[first:last],
            context_lens=attn.context_lens[first:last],
            query_start_loc=attn.query_start_loc[first : last + 1] - begin,
            max_query_len=max(
                b - a for a, b in zip(starts[first:last], starts[first + 1 : last + 1], strict=True)
            ),
            group_slot_mappings=tuple(slots[begin:end] for slots in attn.group_slot_mappings),
            group_block_tables=tuple(tables[first:last] for tables in attn.group_block_tables),
        ),
    )


@dataclass
class AFDStats:
    """What the attention rank's forwards did (the tests read it; the README's table comes from it)."""

    forwards: int = 0
    micro_batches: int = 0
    max_in_flight: int = 0  # most micro-batches at the FFN rank at once (2: the ping-pong overlapped)
    attention_seconds: float = 0.0  # in embeddings, `attend`, `finish` and the final norm
    exchange_seconds: float = 0.0  # starting sends and receives, and waiting for the MLP outputs
    by_micro_batches: dict[int, int] = field(
        default_factory=dict
    )  # forwards by their number of micro-batches


@dataclass
class _Pending:
    """A micro-batch whose MLP input is at the FFN ranks: what its layer's `finish` waits for."""

    residual: Tensor  # [num_tokens, hidden]
    sent: Tensor  # [num_tokens, hidden]: kept alive until the sends completed
    sends: list[Work]  # one to each FFN rank (none on attention ranks other than 0)
    out: Tensor  # [num_tokens, hidden]: the MLP output, once `recv` completed
    recv: Work


# What attention rank 0 tells the FFN ranks before a forward: its micro-batches' token counts and (with LoRA) each
# micro-batch's chunks as `AdapterRun`s.
Announce = Callable[[tuple[int, ...], tuple[tuple[AdapterRun, ...], ...]], None]


class AFDForward:
    """An attention rank's `StepForward`: embeddings, then per layer and micro-batch `attend`, the MLP at the FFN
    ranks, `finish`; the final norm. Every attention rank runs it in lockstep (their shards' o_proj all-reduced
    among them); rank 0 alone sends the MLP inputs (every attention rank holds the same ones) and, by `announce`,
    tells the FFN ranks the micro-batch sizes first; the first FFN rank sends each attention rank the outputs.

    It is a runner hook too (`prepare`: the step's chunks), so that with LoRA each micro-batch's rows run under
    their own adapter slots (`LoRAManager.rows_of`), here and at the FFN ranks."""

    def __init__(
        self,
        model: CausalLM,
        link: ProcessGroupCollectives,
        ranks: AFDRanks,
        announce: Announce | None,
        lora: LoRAManager | None,
    ) -> None:
        """`link`: the world's group (attention and FFN ranks); `announce` on rank 0 only; `lora`: this rank's
        adapter slots (None: LoRA is off)."""
        self.model, self.layers, self.norm = split_model(model)
        self.link = link
        self.ranks = ranks
        self.announce = announce
        self.lora = lora
        self.chunks: Sequence[ScheduledRequest] = ()  # the step's, in row order (`prepare`)
        self.stats = AFDStats()

    def prepare(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Before the forward pass: remember the step's chunks (each micro-batch's adapters come from them)."""
        self.chunks = scheduled

    def select_head_rows(
        self,
        logits_indices: Tensor | None,  # int64 [num_logits_rows]; None: none
    ) -> None:
        """Nothing: the LM head's rows are LoRA's business."""

    def _runs(self, parts: Sequence[MicroBatch]) -> tuple[tuple[AdapterRun, ...], ...]:
        """Each micro-batch's chunks as (adapter, rows) runs; () without LoRA (the FFN ranks need none)."""
        if self.lora is None:
            return ()
        runs: list[list[AdapterRun]] = [[] for _ in parts]
        offset, part = 0, 0
        for chunk in self.chunks:  # micro-batches are cut between sequences, so each chunk lies in one
            while offset >= parts[part].end:
                part += 1
            runs[part].append(AdapterRun(chunk.lora_id, chunk.num_tokens))
            offset += chunk.num_tokens
        return tuple(tuple(r) for r in runs)

    def __call__(
        self,
        input_ids: Tensor,  # int64 [num_tokens]
        positions: Tensor,  # int64 [num_tokens]
        kv_caches: Sequence[LayerKVCache],  # one per layer
        attn: AttentionMetadata,
    ) -> Tensor:  # [num_tokens, hidden]
        """The final hidden states of the step's tokens, the MLPs computed by the FFN rank."""
        parts = micro_batches(attn, ping_pong=True)
        runs = self._runs(parts)
        if self.announce is not None:
            self.announce(tuple(part.end - part.start for part in parts), runs)
        lora = self.lora
        # With LoRA and two micro-batches, the hooks read each micro-batch's own slots, then the step's again.
        whole = None if lora is None else lora.current()
        rows: list[LoRARows | None] = []
        if lora is not None and len(parts) > 1:
            rows = [lora.rows_of(r) for r in runs]
        clock = _Clock()
        inputs = []
        for mb, p in enumerate(parts):
            self._use(rows, mb)
            inputs.append(self.model.layer_inputs(input_ids[p.start : p.end], positions[p.start : p.end]))
        xs = [x for x, _ in inputs]
        pending: list[_Pending | None] = [None] * len(parts)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            for mb, part in enumerate(parts):
                previous = pending[mb]
                if previous is not None:  # the previous layer's MLP output of this micro-batch
                    xs[mb] = self._finish(self.layers[index - 1], previous, clock)
                cos, sin = inputs[mb][1][index]
                self._use(rows, mb)
                residual, normed = layer.attend(xs[mb], cos, sin, kv_cache, part.attn)
                pending[mb] = self._exchange(residual, normed.contiguous(), mb, clock)
                in_flight = sum(p is not None for p in pending)
                self.stats.max_in_flight = max(self.stats.max_in_flight, in_flight)
        for mb, last in enumerate(pending):
            assert last is not None
            xs[mb] = self._finish(self.layers[-1], last, clock)
        if rows and lora is not None:
            lora.use(whole)
        hidden: Tensor = self.norm(xs[0] if len(xs) == 1 else torch.cat(xs))
        clock.lap()
        stats = self.stats
        stats.forwards += 1
        stats.micro_batches += len(parts)
        stats.by_micro_batches[len(parts)] = stats.by_micro_batches.get(len(parts), 0) + 1
        stats.attention_seconds += clock.compute
        stats.exchange_seconds += clock.exchange
        return hidden

    def _use(self, rows: Sequence[LoRARows | None], mb: int) -> None:
        """Point the LoRA hooks at micro-batch `mb`'s rows (nothing when the step is one micro-batch)."""
        if rows and self.lora is not None:
            self.lora.use(rows[mb])

    def _exchange(self, residual: Tensor, normed: Tensor, tag: int, clock: _Clock) -> _Pending:
        """Send a micro-batch's MLP input (rank 0) and post the receive of its output (both asynchronous)."""
        clock.lap()
        ffn_ranks = self.ranks.ffn_ranks() if self.link.rank == 0 else range(0)
        sends = [self.link.send(normed, rank, tag) for rank in ffn_ranks]
        out = torch.empty_like(normed)
        recv = self.link.recv(out, self.ranks.first_ffn, tag)
        clock.lap(exchange=True)
        return _Pending(residual, normed, sends, out, recv)

    def _finish(self, layer: SplitLayer, pending: _Pending, clock: _Clock) -> Tensor:
        """Wait for a micro-batch's MLP output, then the layer's second half."""
        clock.lap()
        for send in pending.sends:
            self.link.wait(send)
        self.link.wait(pending.recv)
        clock.lap(exchange=True)
        return layer.finish(pending.residual, pending.out)


class _Clock:
    """Splits a forward's wall time into compute on this rank and the exchange with the FFN rank."""

    def __init__(self) -> None:
        self.mark = time.perf_counter()
        self.compute = 0.0
        self.exchange = 0.0

    def lap(self, *, exchange: bool = False) -> None:
        """Charge the time since the last lap to the exchange or (by default) to compute."""
        now = time.perf_counter()
        if exchange:
            self.exchange += now - self.mark
        else:
            self.compute += now - self.mark
        self.mark = now
