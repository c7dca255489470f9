"""Batched multi-LoRA ops (punica's BGMV idea): every row of a flat batch applies its own adapter, or none.

`lora_shrink(x, a, slots, scales)` computes h[t] = scale[s] * x[t] @ A[s]^T for the slot s = slots[t] of row t;
`lora_expand(h, b, slots, y, offset=...)` adds h[t] @ B[s]^T into columns offset.. of y[t]; `add_lora` does both.
An embedding adapter's shrink is a lookup, `lora_embedding_shrink(ids, a, slots, scales)`: h[t] = scale[s] *
A[s]^T[ids[t]]. `fused.LoRALayer` binds a projection's pool once and applies all its shards in one call.
A row whose slot is negative has no adapter: it is skipped (its h row is 0 and y keeps its value). Backends:
`torch` (the specification, `torch_lora`), `cpu` (csrc/cpu_lora.c, built by `cbuild`) and `triton` (CUDA, and the
CPU under TRITON_INTERPRET=1); `auto` picks `triton` on CUDA and `cpu` on the CPU when a C compiler builds it.
"""

from pagoda.pagedkernel.lora.ops import (
    LORA_BACKENDS,
    LoRABackendName,
    add_lora,
    lora_embedding_shrink,
    lora_expand,
    lora_shrink,
)

__all__ = [
    "LORA_BACKENDS",
    "LoRABackendName",
    "add_lora",
    "lora_embedding_shrink",
    "lora_expand",
    "lora_shrink",
]
