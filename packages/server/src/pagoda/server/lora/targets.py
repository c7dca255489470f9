"""Where an adapter's modules land in a model: checkpoint projection names onto Linear layers and their shards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagoda.server.models.base import CausalLM, DecoderLM
from pagoda.server.models.layers import Linear, MergedLinear
from pagoda.server.models.parallel_layers import ParallelLMHead, SlicedLoad, SourceSlice

EMBEDDING = "model.embed_tokens"  # PEFT's names of the two vocabulary-sized targets
LM_HEAD = "lm_head"
TargetKind = Literal["linear", "embedding", "head"]


@dataclass(frozen=True, slots=True)
class Target:
    """One checkpoint projection (e.g. `model.layers.0.self_attn.q_proj`) as this rank holds it."""

    module: str  # the Linear's name in the model (a fused one for q/k/v and gate/up)
    shard: int  # index of the projection among the fused module's shards (0 for a plain one)
    in_features: int  # of the whole checkpoint projection
    out_features: int
    rows: SourceSlice | None  # the rows of B this rank holds (column parallel); None: all
    cols: SourceSlice | None  # the columns of A this rank holds (row parallel); None: all
    # "embedding": PEFT's lora_embedding_A [r, vocab] / _B [dim, r], A's columns cut to this rank's vocabulary run;
    # "head": the LM head's (also a tied one: the adapter applies to the logits only), B's rows cut to the run.
    kind: TargetKind = "linear"


def _slice(module: Linear, shard: int | None) -> SourceSlice | None:
    """The checkpoint slice this rank's weight holds."""
    return module.source_slice("weight", shard) if isinstance(module, SlicedLoad) else None


def find_targets(model: CausalLM) -> dict[str, Target]:
    """Every projection of the decoder layers an adapter may target, by checkpoint module name.

    A decoder LM's embedding (`model.embed_tokens`) and LM head (`lm_head`, tied or not) are targets too.
    """
    fused = {(packed.module, packed.index): name for name, packed in model.packed_modules.items()}
    targets: dict[str, Target] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or isinstance(module, ParallelLMHead):
            continue
        parent, _, leaf = name.rpartition(".")
        rows, cols = module.weight_shape()
        if isinstance(module, MergedLinear):
            for index, size in enumerate(module.shard_sizes):
                source = _slice(module, index)
                ckpt = fused.get((leaf, index))
                if ckpt is None:
                    continue
                full = size if source is None else source.full
                targets[f"{parent}.{ckpt}"] = Target(name, index, cols, full, source, None)
            continue
        source = _slice(module, None)
        if source is not None and source.dim == 1:
            targets[name] = Target(name, 0, source.full, rows, None, source)
        else:
            targets[name] = Target(name, 0, cols, rows if source is None else source.full, source, None)
    if isinstance(model, DecoderLM):
        head = model.head()
        vocab, hidden = head.run.num_embeddings, head.weight_shape()[1]
        run = head.run.source()
        targets[EMBEDDING] = Target(EMBEDDING, 0, vocab, hidden, None, run, "embedding")
        targets[LM_HEAD] = Target(LM_HEAD, 0, hidden, vocab, run, None, "head")
    return targets
