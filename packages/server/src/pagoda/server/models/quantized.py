"""Weights held as GGUF blocks: a linear layer's or embedding's matrix as one or more `QuantizedTensor` row runs.

A fused projection (q/k/v, gate/up) whose checkpoint parts share a block type is one tensor and one `qmatmul`;
parts of different types (llama.cpp's mixes, e.g. Q5_0 q/k beside a Q8_0 v) stay separate runs of rows, one
`qmatmul` each, concatenated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pagoda.pagedkernel.quant import (
    QuantBackendName,
    QuantizedTensor,
    cpu_quant,
    dequantize,
    dequantize_ids,
    qmatmul,
    repack,
)
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A weight [N, K] stored as runs of rows in GGUF block formats (first run = first rows)."""

    parts: tuple[QuantizedTensor, ...]
    backend: QuantBackendName = "auto"

    @classmethod
    def of(cls, parts: Sequence[QuantizedTensor], backend: QuantBackendName = "auto") -> QuantizedWeight:
        """Runs of rows merged where neighbours share a block type (one matmul for q/k/v of one type)."""
        runs = runs_of(parts)
        return cls.placed(runs, [None] * len(runs), backend)

    @classmethod
    def placed(
        cls,
        runs: Sequence[Sequence[QuantizedTensor]],
        # Per run, the uint8 memory that holds its parts' bytes in order (`run_copies` put them there); None:
        # the run's parts are concatenated into a new tensor (a run of one part is kept as it is).
        memory: Sequence[Tensor | None],
        backend: QuantBackendName = "auto",
        *,
        repacked: bool = False,
        prompts: bool = True,
    ) -> QuantizedWeight:
        """The weight of `runs_of`'s runs, each run one tensor: `memory`'s (the loader's region of huge pages,
        filled straight from the checkpoint, no concatenation first), or a new one. `repacked`: each run laid out
        as the CPU's kernels multiply it fastest (`cpu_quant.repacked_layout`, told whether the weight multiplies
        prompts' rows; in place where the memory is ours); a layer's run only when its rows are whole tiles of 16
        (the native decode layers' column runs keep to them)."""
        merged: list[QuantizedTensor] = []
        for run, place in zip(runs, memory, strict=True):
            first = run[0]
            rows = sum(part.shape[0] for part in run)
            owned = len(run) > 1 or place is not None  # the bytes are a copy made here, not the checkpoint's
            if not owned:
                part = first
            elif place is None:
                part = QuantizedTensor(
                    torch.cat([p.data.reshape(p.rows, -1) for p in run]), first.qtype, (rows, first.shape[1])
                )
            else:
                part = QuantizedTensor(place.view(rows, -1), first.qtype, (rows, first.shape[1]))
            use_cpu = backend != "torch" and part.data.device.type == "cpu"
            whole_tiles = not prompts or rows % repack.TILE_ROWS == 0
            layout = cpu_quant.repacked_layout(part.qtype, prompts=prompts) if repacked and use_cpu else None
            if layout is not None and whole_tiles:
                part = repack.repack(part, in_place=owned)
            merged.append(part)
        return cls(tuple(merged), backend)

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K] of the whole weight."""
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks held."""
        return sum(p.data.numel() for p in self.parts)

    def matmul(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N] of x's dtype
        """x W^T through the quantized ops (one `qmatmul` per run of rows, each writing its columns in place)."""
        flat = x.reshape(-1, x.shape[-1])  # [rows, K]
        if len(self.parts) == 1:
            y = qmatmul(flat, self.parts[0], backend=self.backend)
        else:
            # Runs of rows of different types (e.g. q and k in one GGUF type, v in another): each writes its own
            # column range of one output, with no torch.cat copy after them.
            y = torch.empty((flat.shape[0], self.shape[0]), dtype=x.dtype, device=x.device)
            start = 0
            for part in self.parts:
                stop = start + part.shape[0]
                qmatmul(flat, part, backend=self.backend, out=y[:, start:stop])
                start = stop
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:  # int64 [num_tokens] -> [num_tokens, K]
        """The rows `ids` (an embedding lookup), dequantizing only those rows."""
        (part,) = self.parts  # an embedding table is one checkpoint tensor
        return dequantize_ids(part, ids, backend=self.backend).to(dtype)

    def dense(self) -> Tensor:  # float32 [N, K]
        """The exact float32 values (for a layer that cannot keep the blocks)."""
        return torch.cat([dequantize(p, backend=self.backend) for p in self.parts])


def runs_of(parts: Sequence[QuantizedTensor]) -> list[list[QuantizedTensor]]:
    """A weight's parts (2-D, in row order) grouped into runs that share a block type and width: each run becomes
    one QuantizedTensor (one matmul). ValueError for no part or one that is not 2-D."""
    runs: list[list[QuantizedTensor]] = []
    for part in parts:
        if len(part.shape) != 2:
            raise ValueError(f"a quantized weight is 2-D [N, K], got shape {part.shape}")
        last = runs[-1][-1] if runs else None
        if last is not None and last.qtype == part.qtype and last.shape[1] == part.shape[1]:
            runs[-1].append(part)
        else:
            runs.append([part])
    if not runs:
        raise ValueError("a quantized weight needs at least one part")
    return runs


def run_bytes(run: Sequence[QuantizedTensor]) -> int:
    """Bytes of a run's blocks."""
    return sum(part.data.numel() * part.data.element_size() for part in run)


def run_copies(run: Sequence[QuantizedTensor], memory: Tensor) -> list[tuple[Tensor, Tensor]]:
    """(destination, source) flat uint8 views that put a run's parts, in order, into `memory` (run_bytes of
    uint8): one batched copy (`torch._foreach_copy_`) can then move every run at once."""
    pairs: list[tuple[Tensor, Tensor]] = []
    start = 0
    for part in run:
        source = part.data.reshape(-1).view(torch.uint8)
        pairs.append((memory[start : start + source.numel()], source))
        start += source.numel()
    return pairs


def placeholder(dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """The empty parameter left in place of a dense weight that is held quantized instead."""
    return nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights the model holds: parameters, buffers, tensor attributes and quantized blocks (each once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        quantized = getattr(module, "quantized", None)
        if isinstance(quantized, QuantizedWeight):
            tensors.extend(p.data for p in quantized.parts)
        # Plain tensor attributes too: e.g. the packed copy of a tied LM head (`DecoderLM.packed_head`).
        tensors.extend(v for v in vars(module).values() if isinstance(v, Tensor))
    for tensor in tensors:
        # Counted by view, not storage: an adopted memory-mapped tensor's storage may span the whole file.
        key = (0, id(tensor)) if tensor.is_mkldnn else (tensor.data_ptr(), tensor.numel())
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total
