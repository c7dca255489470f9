"""`--quantization int8|int4` for safetensors checkpoints: each linear weight (and the embedding / LM head)
quantized at load into blocks, then run by the quantized ops.

- int8: Q8_0 blocks (weight-only, one float16 scale per 32 weights), byte for byte what gguf's reference quantizer
  writes for the same float32 values.
- int4: one float16 scale and minimum per group of `--quantization-group-size` weights (32: GGUF's Q4_1, again
  gguf's bytes; 64 and 128: Pagoda's I4_G64 / I4_G128, the same rule over the larger group). 4.25 to 5 bits a
  weight against int8's 8.5.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pagoda.pagedkernel.quant import (
    BLOCK_SIZES,
    INT4_BY_GROUP,
    GGMLType,
    QuantBackendName,
    QuantizedTensor,
    quantize,
)
from pagoda.server.models import build_model
from pagoda.server.models.layers import QuantizableWeight
from pagoda.server.models.quantized import QuantizedWeight
from torch import Tensor, nn
from transformers import AutoConfig

Q8_0_BLOCK = 32
INT4_GROUP_SIZES = tuple(sorted(INT4_BY_GROUP))
DEFAULT_INT4_GROUP_SIZE = 128  # the common AWQ / GPTQ choice: 4.25 bits a weight


def quantize_q8_0(weight: Tensor) -> QuantizedTensor:  # float [N, K], K a multiple of 32
    """Q8_0 blocks of `weight`'s float32 values, byte for byte as gguf's reference quantizer writes them."""
    return quantize(weight, GGMLType.Q8_0)


def load_qtype(quantization: str | None, group_size: int | None) -> GGMLType | None:
    """The block format `--quantization` (and `--quantization-group-size` for int4) quantizes weights into at load;
    None when nothing is quantized at load."""
    if quantization == "int8":
        return GGMLType.Q8_0
    if quantization == "int4":
        group = DEFAULT_INT4_GROUP_SIZE if group_size is None else group_size
        if group not in INT4_BY_GROUP:
            raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES}, not {group}")
        return INT4_BY_GROUP[group]
    return None


def _scheme(qtype: GGMLType) -> str:
    """How the flags read for `qtype`, for error messages."""
    if qtype == GGMLType.Q8_0:
        return "quantization int8 stores rows in blocks of 32"
    return f"quantization int4 with group size {BLOCK_SIZES[qtype][0]} needs rows in whole groups"


def _targets(model: nn.Module, qtype: GGMLType) -> list[tuple[str, QuantizableWeight]]:
    """The dense weights to quantize; ValueError naming the first layer whose rows are not whole blocks."""
    block = BLOCK_SIZES[qtype][0]
    found: list[tuple[str, QuantizableWeight]] = []
    for name, module in model.named_modules():
        if not isinstance(module, QuantizableWeight) or module.quantized is not None:
            continue
        columns = int(module.weight.shape[1])
        if columns % block:
            raise ValueError(
                f"{_scheme(qtype)}: layer {name} has rows of {columns} ({tuple(module.weight.shape)})"
            )
        found.append((name, module))
    return found


def check_quantizable(model: nn.Module, qtype: GGMLType) -> None:
    """ValueError naming the layer and its sizes when a weight's rows are not whole blocks of `qtype` (works on a
    model built on the meta device, before any weight is read)."""
    _targets(model, qtype)


@torch.no_grad()
def quantize_weights(
    model: nn.Module, qtype: GGMLType = GGMLType.Q8_0, backend: QuantBackendName = "auto"
) -> int:
    """Replace every dense linear / embedding weight by its `qtype` blocks (after loading); how many were.

    ValueError naming the layer and its sizes, before any weight changes, when a weight's rows are not whole blocks.
    """
    targets = _targets(model, qtype)
    for _, module in targets:
        rows = module.quantized_rows()
        weight = module.weight[:rows]  # a padded vocabulary run: its real rows
        module.set_quantized(QuantizedWeight.of([quantize(weight, qtype)], backend))
    return len(targets)


def check_folder_quantizable(folder: str, quantization: str | None, group_size: int | None) -> None:
    """ValueError naming the layer and its sizes when `quantization` at load cannot split `folder`'s weights into
    whole blocks: the model is built on the meta device (shapes only, no weight read), so a bad flag fails at once."""
    qtype = load_qtype(quantization, group_size)
    if qtype is None or not (Path(folder).expanduser() / "config.json").is_file():
        return  # a missing folder is the loader's error to report
    check_quantizable(
        build_model(AutoConfig.from_pretrained(folder), torch.float32, torch.device("meta")), qtype
    )
