"""Native decode layers: a decode step's decoder layers (Llama family, Gemma 3) as one C call on one thread team.

`DecodeStack(layers, shape)` describes a model's layers once (quantized weights, norms, KV caches);
`stack.run(x, cos, sin, slot_mapping, block_tables, context_lens)` runs every layer over a few decode rows in place.
The result is bitwise the server's torch layer on the `cpu` kernels (csrc/cpu_decode.c says how). `available(dtype)`
says whether the library builds here; `supported_qtypes` the GGUF formats it multiplies.
"""

from pagoda.pagedkernel.decode.cpu_decode import (
    ACTIVATIONS,
    DTYPES,
    MAX_ROWS,
    DecodeLayer,
    DecodeShape,
    DecodeStack,
    available,
    kernels,
    supports_weight,
)

__all__ = [
    "ACTIVATIONS",
    "DTYPES",
    "MAX_ROWS",
    "DecodeLayer",
    "DecodeShape",
    "DecodeStack",
    "available",
    "kernels",
    "supports_weight",
]
