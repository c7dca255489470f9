"""A plain float32 copy of a converted model folder, for transformers to load as the reference.

Pagoda's GGUF conversion cache keeps weights in their block formats (uint8 blocks, their types in the safetensors
metadata), which `AutoModelForCausalLM.from_pretrained` cannot read; the copy holds every weight dequantized by
the torch specification, which is bit-exact with gguf's reference dequantization.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from pagoda.pagedkernel.quant import QuantizedTensor, dequantize
from pagoda.server.loader.quantized_cache import columns_of, quantized_types
from safetensors import safe_open
from safetensors.torch import save_file

_WEIGHTS = "model.safetensors"


def dense_copy(folder: Path, target: Path) -> Path:
    """`target` made a copy of the model `folder` whose quantized weights are float32; `folder` itself when it
    holds none (a Hugging Face folder, or a cache converted with --quantization none's format)."""
    with safe_open(str(folder / _WEIGHTS), framework="pt", device="cpu") as f:
        types = quantized_types(f.metadata())
        if not types:
            return folder
        state: dict[str, torch.Tensor] = {}
        names: list[str] = f.keys()  # safe_open is not iterable itself
        for name in names:
            tensor: torch.Tensor = f.get_tensor(name)
            qtype = types.get(name)
            if qtype is not None:  # uint8 [rows, row_bytes] -> float32 [rows, columns]
                shape = (int(tensor.shape[0]), columns_of(qtype, int(tensor.shape[1])))
                tensor = dequantize(QuantizedTensor(tensor.contiguous(), qtype, shape), backend="torch")
            state[name] = tensor
    target.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name != _WEIGHTS and item.is_file():
            shutil.copy2(item, target / item.name)
    save_file(state, str(target / _WEIGHTS))
    return target
