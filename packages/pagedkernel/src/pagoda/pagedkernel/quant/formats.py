"""GGUF block formats: the type ids (gguf's `GGMLQuantizationType` numbers), block sizes and byte sizes.

A row of K weights is stored as K / block_size blocks of type_size bytes each, laid out as ggml writes them
(`ggml-common.h`); `torch_quant.py` decodes each layout, and is its specification here.

Two formats are Pagoda's own, for `--quantization int4` with groups of 64 or 128 (GGUF has Q4_1 for 32): a float16
scale d and minimum m per group, then the group's 4-bit values q, 16 bytes per 32 values in Q4_1's nibble order;
value = d * q + m. They are numbered above 1000, clear of gguf's ids, and never appear in a GGUF file.

`Q8_0_R16`, `Q4_1_R16`, `Q5_0_R16`, `Q4_K_R16` and `Q6_K_R16` are those formats repacked for the CPU's int8 kernel: the same
bytes per row, rows interleaved sixteen to a tile (`repack.py` specifies the layouts and converts both ways). They
are layouts made at load, never read from a file.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor


class GGMLType(enum.IntEnum):
    """A block format supported by the quantized ops: GGUF's, numbered as in gguf's `GGMLQuantizationType`, or ours."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    I4_G64 = 1064  # Pagoda's own (see above): int4, one scale and minimum per 64 values
    I4_G128 = 1128  # the same per 128 values
    Q4_1_R16 = 1203  # Q4_1, Q5_0, Q8_0, Q4_K and Q6_K with rows interleaved sixteen to a tile (repack.py)
    Q5_0_R16 = 1206
    Q8_0_R16 = 1208
    Q4_K_R16 = 1212
    Q6_K_R16 = 1214


QK_K = 256  # elements of a K-quant super-block

# (elements per block, bytes per block) of each type, as in gguf's GGML_QUANT_SIZES.
BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    GGMLType.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    GGMLType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    GGMLType.I4_G64: (64, 2 + 2 + 64 // 2),
    GGMLType.I4_G128: (128, 2 + 2 + 128 // 2),
    # per row, as their source formats'
    GGMLType.Q4_1_R16: (32, 2 + 2 + 16),
    GGMLType.Q5_0_R16: (32, 2 + 4 + 16),
    GGMLType.Q8_0_R16: (32, 2 + 32),
    GGMLType.Q4_K_R16: (QK_K, 2 + 2 + 12 + QK_K // 2),
    GGMLType.Q6_K_R16: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
}

# Pagoda's own formats: not GGUF types, so never looked up by a GGUF tensor's type name.
OWN_TYPES = frozenset({GGMLType.I4_G64, GGMLType.I4_G128})
# Layouts of another format's blocks (made at load by `repack.py`, never in a file): multiplied by the int8 GEMV
# alone.
REPACKED_TYPES = frozenset(
    {GGMLType.Q4_1_R16, GGMLType.Q5_0_R16, GGMLType.Q8_0_R16, GGMLType.Q4_K_R16, GGMLType.Q6_K_R16}
)


def ggml_type(qtype: int | str) -> GGMLType:
    """The supported type named or numbered `qtype` (12, "Q4_K", gguf's enum member); ValueError naming it."""
    found: GGMLType | None = None
    if isinstance(qtype, str):
        found = GGMLType.__members__.get(qtype.upper())
    else:
        try:
            found = GGMLType(int(qtype))
        except ValueError:
            found = None
    if found is None:
        shown = getattr(qtype, "name", qtype)
        supported = ", ".join(t.name for t in GGMLType)
        raise ValueError(f"GGUF type {shown} is not supported by the quantized ops (supported: {supported})")
    return found


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """Weights as stored in a GGUF file: raw uint8 blocks of `qtype`, for a float tensor of `shape`.

    `data` holds the blocks in row-major order (the last dimension of `shape` is split into blocks), e.g. the
    bytes of a GGUF tensor whose dimensions, innermost last, are `shape`; any tensor shape with that many bytes.
    """

    data: Tensor  # uint8 [..., row_bytes]: prod(shape[:-1]) * shape[-1] / block_size * type_size bytes
    qtype: GGMLType
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        """Check that the bytes fit the type and shape (ValueError saying what does not)."""
        if not isinstance(self.qtype, GGMLType):
            raise ValueError(f"qtype must be a GGMLType (see ggml_type), got {self.qtype!r}")
        if self.data.dtype != torch.uint8:
            raise ValueError(f"quantized data must be uint8 bytes, got {self.data.dtype}")
        if not self.shape or any(d < 0 for d in self.shape):
            raise ValueError(f"bad quantized tensor shape {self.shape}")
        block, _ = BLOCK_SIZES[self.qtype]
        if self.shape[-1] % block:
            raise ValueError(
                f"{self.qtype.name} stores rows in blocks of {block}; a last dimension of {self.shape[-1]} is not one"
            )
        if self.data.numel() != self.nbytes:
            raise ValueError(
                f"{self.qtype.name} {self.shape} needs {self.nbytes} bytes, the data has {self.data.numel()}"
            )

    @property
    def rows(self) -> int:
        """How many rows (all dimensions but the last) the tensor has."""
        count = 1
        for d in self.shape[:-1]:
            count *= d
        return count

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of shape[-1] elements."""
        block, size = BLOCK_SIZES[self.qtype]
        return self.shape[-1] // block * size

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.rows * self.row_bytes

    def blocks(self) -> Tensor:  # uint8 [num_blocks, type_size]
        """The data as one row per block (a view when the data is contiguous)."""
        return self.data.reshape(-1, BLOCK_SIZES[self.qtype][1])
