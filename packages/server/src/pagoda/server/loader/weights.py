"""Copy a safetensors checkpoint (single file or sharded) into a model's parameters, strictly."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from pagoda.pagedkernel.quant import BLOCK_SIZES, GGMLType, QuantBackendName, QuantizedTensor, dequantize
from pagoda.server.loader.huge_pages import huge_page_region, release_file_pages
from pagoda.server.loader.quantized_cache import byte_range, columns_of, quantized_types
from pagoda.server.models.base import CausalLM
from pagoda.server.models.layers import MergedLinear, QuantizableWeight
from pagoda.server.models.parallel_layers import (
    ParallelLMHead,
    SlicedLoad,
    SourceSlice,
    VocabParallelEmbedding,
)
from pagoda.server.models.quantized import QuantizedWeight, run_bytes, run_copies, runs_of
from safetensors import SafetensorError, safe_open
from torch import Tensor
from tqdm.auto import tqdm

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
# How many names an error message lists before "...".
_MAX_NAMES_SHOWN = 10


class WeightLoadError(ValueError):
    """A checkpoint does not match the model: missing, unexpected or mis-shaped tensors."""


@dataclass(frozen=True, slots=True)
class _Target:
    """The parameter (and, for a fused projection, the row range) a checkpoint tensor fills."""

    param: str
    shard: int | None  # shard index inside a MergedLinear, None for a whole parameter


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint files of a model folder: the shards of `model.safetensors.index.json`, else the single file."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / SAFETENSORS_SINGLE
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no safetensors weights in {folder}: expected {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} "
        "(PyTorch .bin checkpoints are not supported)"
    )


def _expected_targets(model: CausalLM) -> set[_Target]:
    """Every parameter, and every shard of every fused parameter, that a checkpoint must provide."""
    expected: set[_Target] = set()
    for module_name, module in model.named_modules():
        for attr, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{attr}" if module_name else attr
            if isinstance(module, MergedLinear):
                expected.update(_Target(name, i) for i in range(len(module.shard_sizes)))
            else:
                expected.add(_Target(name, None))
    return expected


def _resolve(model: CausalLM, params: dict[str, Tensor], name: str) -> _Target | None:
    """Where checkpoint tensor `name` goes, or None when the model has no such parameter."""
    name = model.weight_aliases().get(name, name)
    if name in params:
        return _Target(name, None)
    parent, _, rest = name.rpartition(".")  # "model.layers.0.self_attn.q_proj", "weight"
    owner, _, leaf = parent.rpartition(".")
    packed = model.packed_modules.get(leaf)
    if packed is None:
        return None
    fused = f"{owner}.{packed.module}.{rest}" if owner else f"{packed.module}.{rest}"
    return _Target(fused, packed.index) if fused in params else None


def _destination(
    model: CausalLM, params: dict[str, Tensor], target: _Target
) -> tuple[Tensor, SourceSlice | None]:
    """The parameter view that a checkpoint tensor is copied into, and the slice of it this rank holds."""
    param = params[target.param]
    owner_name, _, attr = target.param.rpartition(".")
    owner = model.get_submodule(owner_name)
    source = owner.source_slice(attr, target.shard) if isinstance(owner, SlicedLoad) else None
    if target.shard is not None:
        assert isinstance(owner, MergedLinear), target
        start, rows = owner.shard_rows(target.shard)
        param = param.narrow(0, start, rows)
    if source is not None:  # a padded vocabulary run: the slice fills the first rows
        param = param.narrow(source.dim, 0, source.length)
    return param, source


class DamagedCheckpointError(WeightLoadError):
    """A safetensors file that cannot be read (truncated, bad header): says which folder to delete."""


def _damaged(path: Path, exc: Exception) -> DamagedCheckpointError:
    """The error of a weights file that safetensors cannot read, naming the folder to delete."""
    return DamagedCheckpointError(
        f"the weights file {path} is damaged ({exc}); delete the folder {path.parent} and start again "
        "(a converted GGUF cache is then converted anew; a model folder needs a fresh copy)"
    )


class _Checkpoint:
    """One safetensors file opened lazily (memory-mapped); typed wrapper over the untyped `safe_open`."""

    def __init__(self, path: Path) -> None:
        self._path = path
        try:
            # Opening parses the header and checks its offsets against the file's size (a truncated file fails).
            self._handle = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError) as exc:
            raise _damaged(path, exc) from exc

    def metadata(self) -> dict[str, str]:
        """The file's string metadata (empty when it has none)."""
        found: dict[str, str] | None = self._handle.metadata()  # type: ignore[no-untyped-call]
        return found or {}

    def names(self) -> list[str]:
        """The tensor names in the file."""
        names: list[str] = self._handle.keys()  # type: ignore[no-untyped-call]
        return names

    def get(self, name: str) -> Tensor:
        """One tensor, read from the mapped file."""
        try:
            tensor: Tensor = self._handle.get_tensor(name)  # type: ignore[no-untyped-call]
        except (SafetensorError, OSError) as exc:
            raise _damaged(self._path, exc) from exc
        return tensor

    def get_slice(self, name: str, source: SourceSlice) -> Tensor:
        """Part of one tensor, reading only that part of the mapped file (a rank never holds a whole shard's
        neighbours); WeightLoadError when the tensor's size along the sliced dimension is not the model's."""
        part = self._handle.get_slice(name)  # type: ignore[no-untyped-call]
        full = int(part.get_shape()[source.dim])
        if full != source.full:
            raise WeightLoadError(
                f"{name}: checkpoint size {full} != model size {source.full} in dim {source.dim}"
            )
        index = (slice(None),) * source.dim + (slice(source.start, source.start + source.length),)
        tensor: Tensor = part[index]
        return tensor


def _checkpoint_name(model: CausalLM, target: _Target) -> str:
    """The checkpoint name that fills `target` (e.g. `...self_attn.k_proj.weight` for shard 1 of `qkv_proj`)."""
    if target.shard is None:
        return target.param
    parent, _, attr = target.param.rpartition(".")
    owner, _, fused = parent.rpartition(".")
    leaves = {(packed.module, packed.index): leaf for leaf, packed in model.packed_modules.items()}
    leaf = leaves.get((fused, target.shard), f"{fused}[shard {target.shard}]")
    return f"{owner}.{leaf}.{attr}"


def _names(items: Sequence[str]) -> str:
    """A short, sorted listing of names for an error message."""
    shown = sorted(items)[:_MAX_NAMES_SHOWN]
    more = len(items) - len(shown)
    return ", ".join(shown) + (f", ... ({more} more)" if more else "")


def _read_quantized(
    checkpoint: _Checkpoint, name: str, qtype: GGMLType, source: SourceSlice | None
) -> QuantizedTensor:
    """A cached block-format weight, or this rank's slice of it: whole rows of blocks, or columns on block bounds
    (WeightLoadError naming the tensor when the split does not fall on them)."""
    if source is None:
        raw = checkpoint.get(name)
    elif source.dim == 0:
        raw = checkpoint.get_slice(name, source)
    else:
        block, size = BLOCK_SIZES[qtype]
        columns = byte_range(qtype, source.start, source.length)
        if columns is None or source.full % block:
            raise WeightLoadError(
                f"{name}: {qtype.name} stores columns in blocks of {block}; this rank's columns "
                f"[{source.start}, {source.start + source.length}) of {source.full} are not on block bounds "
                "(use --quantization none, or a tensor-parallel size that splits it on blocks)"
            )
        raw = checkpoint.get_slice(name, SourceSlice(1, *columns, source.full // block * size))
    return QuantizedTensor(raw.contiguous(), qtype, (int(raw.shape[0]), columns_of(qtype, int(raw.shape[1]))))


def _dequantized_slice(
    checkpoint: _Checkpoint,
    name: str,
    qtype: GGMLType,
    source: SourceSlice | None,
    backend: QuantBackendName,
) -> Tensor:  # float32: this rank's slice of the weight
    """This rank's slice of a block-format weight as float32; columns off the block bounds come from the
    dequantized whole rows (what `--quantization none` allows where the blocks cannot be split)."""
    if source is not None and source.dim == 1 and byte_range(qtype, source.start, source.length) is None:
        whole = dequantize(_read_quantized(checkpoint, name, qtype, None), backend=backend)
        return whole.narrow(1, source.start, source.length)
    return dequantize(_read_quantized(checkpoint, name, qtype, source), backend=backend)


def _install_quantized(
    model: CausalLM,
    pending: dict[str, dict[int, tuple[Tensor, QuantizedTensor]]],
    backend: QuantBackendName,
    before_copies: Callable[[], None] | None = None,
) -> None:
    """Hand each layer its blocks when every part of its weight came quantized; dequantize into the dense
    weight otherwise (a fused layer whose parts mix block formats with plain floats). `before_copies` is called
    once every file read is planned, right before the bulk copy (see `load_safetensors`)."""
    # Each layer's parts in runs of one block type (a fused q/k/v of one type is one run: one matmul).
    installs: list[tuple[QuantizableWeight, list[list[QuantizedTensor]]]] = []
    for param, parts in pending.items():
        owner = model.get_submodule(param.rpartition(".")[0])
        count = len(owner.shard_sizes) if isinstance(owner, MergedLinear) else 1
        if isinstance(owner, QuantizableWeight) and sorted(parts) == list(range(count)):
            installs.append((owner, runs_of([parts[i][1] for i in range(count)])))
            continue
        for dest, quantized in parts.values():
            dest.copy_(dequantize(quantized, backend=backend))
    # Every step reads these blocks whole: from one region of 2 MiB pages rather than the file mapping's 4 KiB ones,
    # each run copied there straight from the checkpoint (merged in place: no concatenation first).
    runs = [run for _, weight_runs in installs for run in weight_runs]
    on_cpu = all(part.data.device.type == "cpu" for run in runs for part in run)
    region = huge_page_region([run_bytes(run) for run in runs]) if on_cpu else None
    if before_copies is not None:
        before_copies()
    if region is not None:
        pairs = [pair for run, memory in zip(runs, region, strict=True) for pair in run_copies(run, memory)]
        # One call for every copy: it runs without the GIL throughout (page faults of the huge pages included),
        # beside what other threads do meanwhile (the tokenizer's loading).
        torch._foreach_copy_([dest for dest, _ in pairs], [source for _, source in pairs])
    places: Iterator[Tensor | None] = iter(region) if region is not None else itertools.repeat(None)
    for owner, weight_runs in installs:
        memory = [next(places) for _ in weight_runs]
        # Every reader of the blocks (the module path's qmatmul, the native decode layers, the fused head, row
        # lookups) takes the CPU's repacked layouts, whose int8 kernel runs at about the int8 peak from a few rows
        # (pagedkernel README, cpu backend); a vocabulary table multiplies only the rows sampled, never a prompt's.
        vocabulary = isinstance(owner, VocabParallelEmbedding | ParallelLMHead)
        placed = QuantizedWeight.placed(weight_runs, memory, backend, repacked=True, prompts=not vocabulary)
        owner.set_quantized(placed)
    if region is not None:  # the checkpoint's pages the copies read need not stay resident too
        release_file_pages([quantized.data for parts in pending.values() for _, quantized in parts.values()])


@torch.no_grad()
def load_safetensors(
    model: CausalLM,
    files: Sequence[Path],
    *,
    keep_quantized: bool = True,
    quant_backend: QuantBackendName = "auto",
    before_copies: Callable[[], None] | None = None,
) -> None:
    """Fill every parameter of `model` from `files`, casting to the parameter dtype and device.

    `before_copies` is called once the Python-side work is done and only the bulk copy of the quantized blocks
    is left (a C call that holds no GIL): the loader starts the tokenizer's thread there, so that neither waits
    for the other's hold on the GIL.

    Block-format weights (a converted GGUF's, see `quantized_cache`) stay quantized in their layers with
    `keep_quantized`, multiplied by the `quant_backend` ops; without it they are dequantized into the dense
    parameters. Raises `WeightLoadError` when a tensor has no parameter, a shape differs, or a parameter stays
    unloaded.
    """
    params: dict[str, Tensor] = dict(model.named_parameters(remove_duplicate=False))
    ignored = model.ignored_weights()
    expected = _expected_targets(model)
    loaded: set[_Target] = set()
    unexpected: list[str] = []
    checkpoints = [_Checkpoint(path) for path in files]
    total = sum(len(checkpoint.names()) for checkpoint in checkpoints)
    # param name -> shard -> (the dense view it would fill, its blocks)
    pending: dict[str, dict[int, tuple[Tensor, QuantizedTensor]]] = {}
    with tqdm(total=total, desc="Loading weights", unit="tensor", leave=False) as progress:
        for checkpoint in checkpoints:
            qtypes = quantized_types(checkpoint.metadata())
            for name in checkpoint.names():
                progress.update(1)
                renamed = model.checkpoint_name(name)
                target = _resolve(model, params, renamed)
                if target is None:
                    if renamed not in ignored:
                        unexpected.append(name)
                    continue
                dest, source = _destination(model, params, target)
                qtype = qtypes.get(name)
                if qtype is not None:
                    keep = keep_quantized and target.param.endswith(".weight")
                    if keep:
                        quantized = _read_quantized(checkpoint, name, qtype, source)
                        if quantized.data.device != dest.device:  # blocks live where the activations do
                            quantized = QuantizedTensor(
                                quantized.data.to(dest.device), quantized.qtype, quantized.shape
                            )
                        pending.setdefault(target.param, {})[target.shard or 0] = (dest, quantized)
                        shape = quantized.shape
                    else:
                        values = _dequantized_slice(checkpoint, name, qtype, source, quant_backend)
                        shape = tuple(values.shape)
                    if shape != tuple(dest.shape):
                        raise WeightLoadError(
                            f"{name}: checkpoint shape {shape} != model shape {tuple(dest.shape)}"
                        )
                    if not keep:
                        dest.copy_(values)
                    loaded.add(target)
                    continue
                tensor = checkpoint.get(name) if source is None else checkpoint.get_slice(name, source)
                if tensor.shape != dest.shape:
                    raise WeightLoadError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dest.shape)}"
                    )
                param = params[target.param]
                whole = target.shard is None and dest.shape == param.shape
                if whole and tensor.dtype == dest.dtype and tensor.device == dest.device:
                    # Adopt the memory-mapped tensor instead of copying it: no second 1 GB buffer, pages are
                    # read on first use and shared through the page cache by every process serving the model.
                    param.data = tensor
                else:
                    dest.copy_(tensor)
                loaded.add(target)
    _install_quantized(model, pending, quant_backend, before_copies)
    if unexpected:
        raise WeightLoadError(f"checkpoint tensors with no matching parameter: {_names(unexpected)}")
    missing = expected - loaded
    if missing:
        described = [_checkpoint_name(model, target) for target in missing]
        raise WeightLoadError(f"weights missing from the checkpoint: {_names(described)}")
