"""Weights held as GGUF blocks: a linear layer's or embedding's matrix as one or more `QuantizedTensor` row runs.

A fused projection (q/k/v, gate/up) whose checkpoint parts share a block type is one tensor and one `qmatmul`;
parts of different types (llama.cpp's mixes, e.g. Q5_0 q/k beside a Q8_0 v) stay separate runs of rows, one
`qmatmul` each, concatenated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pagoda.pagedkernel.quant import QuantBackendName, QuantizedTensor, dequantize, qmatmul
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A weight [N, K] stored as runs of rows in GGUF block formats (first run = first rows)."""

    parts: tuple[QuantizedTensor, ...]
    backend: QuantBackendName = "auto"

    @classmethod
    def of(cls, parts: Sequence[QuantizedTensor], backend: QuantBackendName = "auto") -> QuantizedWeight:
        """Runs of rows merged where neighbours share a block type (one matmul for q/k/v of one type)."""
        merged: list[QuantizedTensor] = []
        for part in parts:
            if len(part.shape) != 2:
                raise ValueError(f"a quantized weight is 2-D [N, K], got shape {part.shape}")
            last = merged[-1] if merged else None
            if last is not None and last.qtype == part.qtype and last.shape[1] == part.shape[1]:
                data = torch.cat((last.data.reshape(last.rows, -1), part.data.reshape(part.rows, -1)))
                merged[-1] = QuantizedTensor(data, part.qtype, (last.shape[0] + part.shape[0], part.shape[1]))
            else:
                merged.append(part)
        if not merged:
            raise ValueError("a quantized weight needs at least one part")
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
        picked = part.data.reshape(part.rows, -1).index_select(0, ids)  # uint8 [num_tokens, row_bytes]
        gathered = QuantizedTensor(picked, part.qtype, (int(ids.shape[0]), part.shape[1]))
        return dequantize(gathered, backend=self.backend).to(dtype)

    def dense(self) -> Tensor:  # float32 [N, K]
        """The exact float32 values (for a layer that cannot keep the blocks)."""
        return torch.cat([dequantize(p, backend=self.backend) for p in self.parts])


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
