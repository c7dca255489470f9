"""A .gguf file's header checked before anything reads it for real (issue 43 item 11).

gguf's reader (and transformers' conversion behind it) trusts the header: a tensor or string count decides how
much it allocates, a dimension product may overflow, an offset may point past the end of the file. This walk
reads the header with every count, length and offset bounded by the file's size, and every type id known, so a
crafted file is a `GGUFFileError` (a ValueError: bad input, `pagoda serve` exits 2) naming what is wrong, before
a byte of tensor data is read or any buffer sized by the file is allocated.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
# Fixed-size GGUF value types by id (uint8 ... float64); 8 is a string, 9 an array.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_NESTING = 4  # arrays of arrays: real files nest none; a bound keeps the walk's recursion shallow
# The fewest header bytes one tensor description and one key/value pair can take (so counts are bounded by size).
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_MIN_KV = 8 + 4 + 1  # key length, value type, the smallest value


class GGUFFileError(ValueError):
    """A .gguf file that is not a well-formed GGUF (the message names the file and the first problem)."""


def _quant_sizes() -> dict[int, tuple[int, int]]:
    """Each known tensor type id: (elements per block, bytes per block), from gguf's own table."""
    from gguf import GGML_QUANT_SIZES

    return {int(kind): (int(block), int(size)) for kind, (block, size) in GGML_QUANT_SIZES.items()}


class _Cursor:
    """Bounded reads over the file's bytes: every read past the end is a GGUFFileError."""

    def __init__(self, data: mmap.mmap | bytes, path: Path) -> None:
        self.data, self.path, self.pos = data, path, 0

    def fail(self, problem: str) -> GGUFFileError:
        """The error for `problem`, naming the file and where it was found."""
        return GGUFFileError(f"{self.path} is not a valid GGUF file: {problem} (at byte {self.pos})")

    def take(self, size: int, what: str) -> bytes:
        """The next `size` bytes, read as `what`."""
        if size < 0 or size > len(self.data) - self.pos:
            raise self.fail(f"{what} needs {size} bytes, past the end of the {len(self.data)}-byte file")
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return bytes(chunk)

    def skip(self, size: int, what: str) -> None:
        """Move past `size` bytes of `what`, without copying them."""
        if size < 0 or size > len(self.data) - self.pos:
            raise self.fail(f"{what} needs {size} bytes, past the end of the {len(self.data)}-byte file")
        self.pos += size

    def skip_strings(self, number: int, what: str) -> None:
        """Move past `number` strings (a vocabulary's 262k take one tight loop, not a call each)."""
        data, pos, end = self.data, self.pos, len(self.data)
        for _ in range(number):
            if end - pos < 8:
                break
            pos += 8 + int.from_bytes(data[pos : pos + 8], "little")
            if pos > end:
                break
        else:
            self.pos = pos
            return
        self.pos = min(pos, end)
        raise self.fail(f"the strings of {what} run past the end of the {end}-byte file")

    def u32(self, what: str) -> int:
        """A little-endian uint32."""
        return int(struct.unpack("<I", self.take(4, what))[0])

    def u64(self, what: str) -> int:
        """A little-endian uint64."""
        return int(struct.unpack("<Q", self.take(8, what))[0])

    def count(self, what: str, min_item_bytes: int) -> int:
        """A uint64 count of items, each at least `min_item_bytes` long: more than the file can hold is an error."""
        number = self.u64(what)
        left = len(self.data) - self.pos
        if number * min_item_bytes > left:
            raise self.fail(f"{what} is {number}, more than the {left} bytes left can hold")
        return number

    def string(self, what: str) -> bytes:
        """A GGUF string: a uint64 length, then that many bytes."""
        return self.take(self.count(f"the length of {what}", 1), what)


def _skip_value(cursor: _Cursor, kind: int, key: str, depth: int = 0) -> None:
    """Move past one value of type `kind` (arrays walked, their element counts bounded by the file)."""
    if kind in _SCALAR_SIZES:
        cursor.skip(_SCALAR_SIZES[kind], f"the value of {key}")
    elif kind == _STRING:
        cursor.skip(cursor.count(f"the length of {key}", 1), f"the value of {key}")
    elif kind == _ARRAY and depth < _MAX_NESTING:
        inner = cursor.u32(f"the element type of {key}")
        if inner in _SCALAR_SIZES:
            size = _SCALAR_SIZES[inner]
            cursor.skip(size * cursor.count(f"the element count of {key}", size), f"the elements of {key}")
            return
        number = cursor.count(f"the element count of {key}", 8)
        if inner == _STRING:
            cursor.skip_strings(number, key)
            return
        for _ in range(number):
            _skip_value(cursor, inner, key, depth + 1)
    else:
        raise cursor.fail(f"value type {kind} of {key} is not a GGUF value type")


def _read_alignment(cursor: _Cursor, key: str, kind: int) -> int:
    """`general.alignment`: a power of two (a uint32, as llama.cpp writes it)."""
    if kind != 4:
        raise cursor.fail(f"{key} has value type {kind}, not uint32")
    alignment = cursor.u32(key)
    if alignment <= 0 or alignment & (alignment - 1):
        raise cursor.fail(f"{key} is {alignment}, not a power of two")
    return alignment


def check_gguf_file(path: Path) -> None:
    """GGUFFileError unless `path` is a GGUF file whose header is consistent with its size (see the module)."""
    sizes = _quant_sizes()
    try:
        with path.open("rb") as handle:
            if path.stat().st_size == 0:
                raise GGUFFileError(f"{path} is not a valid GGUF file: it is empty")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _check_header(_Cursor(data, path), sizes)
    except OSError as exc:
        raise GGUFFileError(f"{path} cannot be read: {exc.strerror or exc}") from None


def _check_header(cursor: _Cursor, sizes: dict[int, tuple[int, int]]) -> None:
    """Walk magic, version, key/values and tensor descriptions; check each tensor's bytes lie in the file."""
    if cursor.take(4, "the magic") != _MAGIC:
        raise cursor.fail("it does not start with the GGUF magic")
    version = cursor.u32("the version")
    if version not in _VERSIONS:
        raise cursor.fail(f"version {version} is not one of {_VERSIONS}")
    tensors = cursor.u64("the tensor count")
    pairs = cursor.count("the key/value count", _MIN_KV)
    if tensors * _MIN_TENSOR_INFO > len(cursor.data) - cursor.pos:
        raise cursor.fail(f"the tensor count is {tensors}, more than the file can describe")
    alignment = _DEFAULT_ALIGNMENT
    for index in range(pairs):
        key = cursor.string(f"key {index}").decode("utf-8", "replace")
        kind = cursor.u32(f"the value type of {key}")
        if key == "general.alignment":
            alignment = _read_alignment(cursor, key, kind)
        else:
            _skip_value(cursor, kind, key)
    spans: list[tuple[int, int, str]] = []
    for index in range(tensors):
        name = cursor.string(f"the name of tensor {index}").decode("utf-8", "replace")
        spans.append((*_tensor_span(cursor, name, sizes), name))
    data_start = -(-cursor.pos // alignment) * alignment
    room = len(cursor.data) - data_start
    for offset, nbytes, name in spans:
        if offset % alignment:
            raise cursor.fail(
                f"tensor {name}'s offset {offset} is not a multiple of the alignment {alignment}"
            )
        if offset + nbytes > room:
            raise cursor.fail(
                f"tensor {name} ({nbytes} bytes at offset {offset}) ends past the end of the file's "
                f"{room} data bytes"
            )


def _tensor_span(cursor: _Cursor, name: str, sizes: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """One tensor description: (offset, bytes) once its dimensions and type are checked."""
    n_dims = cursor.u32(f"the dimension count of {name}")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise cursor.fail(f"tensor {name} has {n_dims} dimensions, not 1 to {_MAX_DIMS}")
    dims = [cursor.u64(f"a dimension of {name}") for _ in range(n_dims)]
    kind = cursor.u32(f"the type of {name}")
    if kind not in sizes:
        raise cursor.fail(f"tensor {name} has type id {kind}, which no GGML type has")
    offset = cursor.u64(f"the offset of {name}")
    block, block_bytes = sizes[kind]
    if any(dim == 0 for dim in dims):
        raise cursor.fail(f"tensor {name} has a zero dimension {dims}")
    if dims[0] % block:
        raise cursor.fail(f"tensor {name}'s rows of {dims[0]} are not whole blocks of {block}")
    elements = 1
    for dim in dims:  # Python integers do not overflow: a product past the file's size is caught below
        elements *= dim
    nbytes = elements // block * block_bytes
    if nbytes > len(cursor.data):
        raise cursor.fail(f"tensor {name} of shape {dims} needs {nbytes} bytes, more than the whole file")
    return offset, nbytes
