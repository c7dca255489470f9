"""`--quantization int8` for safetensors checkpoints: each linear weight (and the embedding / LM head) quantized at
load into Q8_0 blocks (weight-only int8, one float16 scale per 32 weights), then run by the quantized ops.

The blocks are the ones gguf's reference quantizer (`gguf.quants.quantize`, ggml's `quantize_row_q8_0`) writes
for the same float32 values: d = max|w| / 127 per block, q = w / d rounded half away from zero.
"""

from __future__ import annotations

import torch
from pagoda.pagedkernel.quant import GGMLType, QuantBackendName, QuantizedTensor
from pagoda.server.models.layers import QuantizableWeight
from pagoda.server.models.quantized import QuantizedWeight
from torch import Tensor, nn

Q8_0_BLOCK = 32


def quantize_q8_0(weight: Tensor) -> QuantizedTensor:  # float [N, K], K a multiple of 32
    """Q8_0 blocks of `weight`'s float32 values, byte for byte as gguf's reference quantizer writes them."""
    rows, k = weight.shape
    blocks = weight.detach().to(torch.float32).reshape(-1, Q8_0_BLOCK)  # [N * K / 32, 32]
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    # Half away from zero, as ggml's roundf (torch.round rounds half to even).
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    raw = torch.cat((d.to(torch.float16).view(torch.uint8), q.to(torch.int8).view(torch.uint8)), dim=1)
    return QuantizedTensor(raw.reshape(rows, -1).contiguous(), GGMLType.Q8_0, (int(rows), int(k)))


@torch.no_grad()
def quantize_weights(model: nn.Module, backend: QuantBackendName = "auto") -> int:
    """Replace every dense linear / embedding weight by its Q8_0 blocks (after loading); how many were.

    ValueError naming the layer and its sizes when a weight's rows are not whole blocks of 32.
    """
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, QuantizableWeight) or module.quantized is not None:
            continue
        rows = module.quantized_rows()
        weight = module.weight[:rows]  # a padded vocabulary run: its real rows
        if weight.shape[1] % Q8_0_BLOCK:
            raise ValueError(
                f"quantization int8 stores rows in blocks of {Q8_0_BLOCK}: layer {name} has rows of "
                f"{weight.shape[1]} ({tuple(module.weight.shape)})"
            )
        module.set_quantized(QuantizedWeight.of([quantize_q8_0(weight)], backend))
        count += 1
    return count
