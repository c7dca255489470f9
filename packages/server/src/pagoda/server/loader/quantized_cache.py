"""GGUF blocks in the conversion cache: which weights keep their file's format, stored as uint8 rows.

A kept weight [N, K] is a uint8 tensor [N, K / block * type_size] under its Hugging Face name, its type named in
the safetensors metadata (`QUANTIZED_METADATA`, JSON {name: "Q8_0", ...}). Each is checked against transformers'
own float32 conversion of the same tensor (bit-exact, up to llama.cpp's reordering of q/k rows), so a weight whose
name or processing the check does not confirm stays float32, as it was before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from pagoda.pagedkernel.quant import BLOCK_SIZES, GGMLType, QuantizedTensor, dequantize
from torch import Tensor

if (
    TYPE_CHECKING
):  # transformers' modeling module takes ~0.7 s to import (torch._dynamo); serving never needs it
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

QUANTIZED_METADATA = "pagoda.quantized"
# GGUF types that are plain floats: stored float32, as before.
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def quantized_type(name: str, tensor_type: object) -> GGMLType | None:
    """The supported block type of a GGUF tensor; None for plain floats, and for unsupported types (warned)."""
    type_name = str(getattr(tensor_type, "name", tensor_type))
    if type_name in _FLOAT_TYPES:
        return None
    try:
        return GGMLType[type_name]
    except KeyError:
        supported = ", ".join(t.name for t in GGMLType)
        logger.warning(
            "GGUF tensor %s is of type %s, which the quantized ops do not support (%s): dequantized to float32",
            name,
            type_name,
            supported,
        )
        return None


def _row_orders(rows: int, config: Mapping[str, object]) -> list[Tensor | None]:
    """Candidate row orders of a GGUF matrix: as stored, and undoing llama.cpp's q/k rotary interleave."""
    orders: list[Tensor | None] = [None]
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = config.get(key)
        if isinstance(heads, int) and heads > 0 and rows % (2 * heads) == 0:
            index = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
            orders.append(index)
    return orders


def _matching_blocks(
    raw: Tensor,  # uint8 [N, row_bytes]
    qtype: GGMLType,
    want: Tensor,  # float32 [N, K]: transformers' conversion of the tensor
    config: Mapping[str, object],
) -> Tensor | None:  # uint8 [N, row_bytes] in the order whose values equal `want`
    """The blocks, reordered if needed, that dequantize bit-exactly to `want`; None when no order does."""
    for order in _row_orders(int(want.shape[0]), config):
        candidate = raw if order is None else raw.index_select(0, order)
        values = dequantize(QuantizedTensor(candidate, qtype, (int(want.shape[0]), int(want.shape[1]))))
        if torch.equal(values.view(torch.int32), want.view(torch.int32)):
            return candidate.contiguous()
    return None


def quantized_state(
    gguf_path: Path, hf_model: PreTrainedModel, dense: Mapping[str, Tensor]
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors to cache (`dense` with each verified block-format weight replaced by its uint8 rows) and the
    safetensors metadata naming those weights' types."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    names: dict[str, str] = get_gguf_hf_weights_map(hf_model, TensorProcessor())  # type: ignore[no-untyped-call]
    config = hf_model.config.to_dict()
    state = dict(dense)
    kept: dict[str, str] = {}
    for tensor in GGUFReader(str(gguf_path)).tensors:
        hf_name = names.get(tensor.name)
        want = state.get(hf_name) if hf_name is not None else None
        if want is None:
            continue
        qtype = quantized_type(tensor.name, tensor.tensor_type)
        if qtype is None:
            continue
        if want.dim() != 2 or want.dtype != torch.float32:
            logger.warning(
                "GGUF tensor %s (%s) is not a float32 matrix here: kept dequantized", tensor.name, hf_name
            )
            continue
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).reshape(int(want.shape[0]), -1)
        blocks = _matching_blocks(raw, qtype, want, config)
        if blocks is None:
            logger.warning(
                "GGUF tensor %s (%s, %s) does not dequantize to transformers' conversion: kept dequantized",
                tensor.name,
                hf_name,
                qtype.name,
            )
            continue
        assert hf_name is not None
        state[hf_name] = blocks
        kept[hf_name] = qtype.name
    logger.info("GGUF: %d of %d weights kept in their block formats", len(kept), len(state))
    return state, {QUANTIZED_METADATA: json.dumps(kept, sort_keys=True)} if kept else {}


def quantized_types(metadata: Mapping[str, str] | None) -> dict[str, GGMLType]:
    """The block type of each cached quantized weight, from a safetensors file's metadata."""
    listed = (metadata or {}).get(QUANTIZED_METADATA)
    if not listed:
        return {}
    return {name: GGMLType[type_name] for name, type_name in json.loads(listed).items()}


def columns_of(qtype: GGMLType, row_bytes: int) -> int:
    """Elements in a row of `row_bytes` bytes of `qtype`."""
    block, size = BLOCK_SIZES[qtype]
    return row_bytes // size * block


def byte_range(qtype: GGMLType, start: int, length: int) -> tuple[int, int] | None:
    """The bytes of columns [start, start + length) of a row, or None when they do not fall on block bounds."""
    block, size = BLOCK_SIZES[qtype]
    if start % block or length % block:
        return None
    return start // block * size, length // block * size
