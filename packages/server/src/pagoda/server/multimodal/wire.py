"""A prompt's images on the wire between a front end and an engine core: msgspec Structs of raw tensor bytes
(never pickle), decoded back into `MultiModalInputs` exactly."""

from __future__ import annotations

import msgspec
import torch
from pagoda.server.multimodal.inputs import ImageItem, MultiModalInputs
from torch import Tensor

# The dtypes a processor's tensors come in; anything else is refused on both sides.
_DTYPES = {
    str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64)
}


class WireTensor(msgspec.Struct, frozen=True):
    """A CPU tensor as its dtype name, shape and bytes."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, tensor: Tensor) -> WireTensor:
        """The wire form of `tensor` (contiguous, on the CPU); ValueError for a dtype not carried."""
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"a {name} tensor cannot go on the wire")
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        return cls(name, list(tensor.shape), flat.view(torch.uint8).numpy().tobytes())

    def tensor(self) -> Tensor:
        """The tensor back; ValueError when dtype, shape and bytes disagree."""
        dtype = _DTYPES.get(self.dtype)
        if dtype is None:
            raise ValueError(f"unknown tensor dtype {self.dtype!r} on the wire")
        raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        numel = 1
        for size in self.shape:
            numel *= size
        if raw.numel() != numel * dtype.itemsize:
            raise ValueError(f"{len(self.data)} bytes for a {self.dtype} tensor of shape {self.shape}")
        return raw.view(dtype).reshape(self.shape)


class WireImage(msgspec.Struct, frozen=True):
    """One `ImageItem`."""

    offset: int
    length: int
    content_key: int
    tensors: dict[str, WireTensor]


class WireMultiModal(msgspec.Struct, frozen=True):
    """One `MultiModalInputs`."""

    images: list[WireImage]
    mrope_positions: WireTensor | None = None
    mrope_delta: int = 0

    @classmethod
    def of(cls, inputs: MultiModalInputs) -> WireMultiModal:
        """The wire form of a prompt's images."""
        images = [
            WireImage(i.offset, i.length, i.content_key, {k: WireTensor.of(t) for k, t in i.tensors.items()})
            for i in inputs.images
        ]
        mrope = None if inputs.mrope_positions is None else WireTensor.of(inputs.mrope_positions)
        return cls(images, mrope, inputs.mrope_delta)

    def inputs(self) -> MultiModalInputs:
        """The prompt's images back."""
        images = tuple(
            ImageItem(i.offset, i.length, i.content_key, {k: t.tensor() for k, t in i.tensors.items()})
            for i in self.images
        )
        mrope = None if self.mrope_positions is None else self.mrope_positions.tensor()
        return MultiModalInputs(images, mrope, self.mrope_delta)
