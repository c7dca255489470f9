"""Hand-written GGUF bytes with any header field chosen, for the crafted-file tests (issue 43 item 11)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

_ALIGN = 32


@dataclass
class CraftedTensor:
    """One tensor description: name, dimensions, GGML type id, offset into the data section."""

    name: str = "token_embd.weight"
    dims: tuple[int, ...] = (32, 4)
    type_id: int = 0  # F32
    offset: int = 0


@dataclass
class CraftedGGUF:
    """A GGUF file's header fields; `bytes()` writes them, counts included, as given (however absurd)."""

    version: int = 3
    tensors: list[CraftedTensor] = field(default_factory=lambda: [CraftedTensor()])
    tensor_count: int | None = None  # None: len(tensors)
    kv_count: int | None = None  # None: the one key written
    key_length: int | None = None  # None: the key's true length
    value_type: int = 8  # a string
    data_bytes: int = 32 * 4 * 4

    def to_bytes(self) -> bytes:
        """The file's bytes."""
        key, value = b"general.architecture", b"llama"
        out = bytearray(b"GGUF")
        out += struct.pack(
            "<IQQ", self.version, _count(self.tensor_count, len(self.tensors)), _count(self.kv_count, 1)
        )
        out += struct.pack("<Q", _count(self.key_length, len(key))) + key
        out += struct.pack("<I", self.value_type) + struct.pack("<Q", len(value)) + value
        for tensor in self.tensors:
            name = tensor.name.encode()
            out += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(tensor.dims))
            out += b"".join(struct.pack("<Q", dim & (2**64 - 1)) for dim in tensor.dims)
            out += struct.pack("<IQ", tensor.type_id, tensor.offset & (2**64 - 1))
        out += b"\0" * (-len(out) % _ALIGN)
        return bytes(out + b"\0" * self.data_bytes)


def _count(given: int | None, actual: int) -> int:
    return (actual if given is None else given) & (2**64 - 1)
