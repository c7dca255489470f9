"""Quantized weights on the CPU: GGUF block formats as pagedkernel ops (dequantize, and a matmul through them).

`QuantizedTensor` holds a GGUF tensor's raw blocks; `dequantize` returns its float32 values (bit-exact with gguf's
reference; `dequantize_ids` those of some rows, an embedding lookup), `qmatmul(x, weight)` computes x @ W^T,
`quantize(w, qtype)` writes Q8_0, Q4_1 or Pagoda's int4 groups;
`repack.repack` lays Q8_0, Q4_1, Q5_0, Q4_K and Q6_K out for the CPU's int8 kernel (`Q8_0_R16`, `Q4_1_R16`,
`Q5_0_R16`, `Q4_K_R16`, `Q6_K_R16`; `repack.unpack` and `repack.take_rows` read them back). Backends: `torch` (the specification, `torch_quant`) and `cpu`
(the C kernels of `cpu_quant`); `auto` is `cpu` for CPU tensors when a C compiler builds it, else `torch`.
"""

from pagoda.pagedkernel.quant.formats import BLOCK_SIZES, GGMLType, QuantizedTensor, ggml_type
from pagoda.pagedkernel.quant.ops import QUANT_BACKENDS, QuantBackendName, dequantize, dequantize_ids, qmatmul
from pagoda.pagedkernel.quant.quantize import INT4_BY_GROUP, QUANTIZABLE, quantize

__all__ = [
    "BLOCK_SIZES",
    "INT4_BY_GROUP",
    "QUANTIZABLE",
    "QUANT_BACKENDS",
    "GGMLType",
    "QuantBackendName",
    "QuantizedTensor",
    "dequantize",
    "dequantize_ids",
    "ggml_type",
    "qmatmul",
    "quantize",
]
