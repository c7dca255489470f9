"""Huge pages for the weights a step reads whole: a copy in anonymous memory advised MADV_HUGEPAGE."""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import mmap
from collections.abc import Sequence

import torch
from torch import Tensor

_HUGE_PAGE_BYTES = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line
_PAGE_BYTES = mmap.PAGESIZE
_MADV_DONTNEED = 4  # Linux's value (mman.h)
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages() -> bool:
    """Whether this kernel backs memory advised MADV_HUGEPAGE with transparent huge pages ("always" or
    "madvise"; not "never", nor a system without the setting)."""
    try:
        with open(_THP_SETTING) as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False


def huge_page_copies(tensors: Sequence[Tensor]) -> list[Tensor] | None:
    """The (CPU, contiguous) `tensors` copied into one fresh anonymous region advised MADV_HUGEPAGE before its
    first touch, 64-byte aligned each; None where that does not apply (not all on the CPU, under 2 MiB in all, no
    transparent huge pages). See `huge_page_region`."""
    if any(t.device.type != "cpu" for t in tensors):
        return None
    region = huge_page_region([t.numel() * t.element_size() for t in tensors])
    if region is None:
        return None
    copies = []
    for tensor, memory in zip(tensors, region, strict=True):
        out = memory.view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        copies.append(out)
    return copies


def huge_page_region(sizes: Sequence[int]) -> list[Tensor] | None:
    """Fresh uint8 memory of each size, in one anonymous region advised MADV_HUGEPAGE before its first touch,
    64-byte aligned each; None where that does not apply (under 2 MiB in all, no transparent huge pages).

    Weights read whole every step (a quantized model's blocks: the default model's 178 MB Q8_0 LM head and 75 MB
    of layers) pay a TLB miss every 4 KiB page they stream: memory-mapped from the checkpoint file, or taken from
    glibc's heap, they sit in 4 KiB pages. Measured on a 2-core Sapphire Rapids Xeon, that head's one-row GEMV:
    12.2 ms from the file mapping, 7.7 ms from 2 MiB pages. One region serves the small weights too (a layer's
    1-2 MB would not fill a page of its own). The copies keep the region alive; it is freed with the last of them.
    """
    offsets = list(itertools.accumulate((-(-n // _ALIGN) * _ALIGN for n in sizes), initial=0))
    if offsets[-1] < _HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE") or not transparent_huge_pages():
        return None
    length = -(-offsets[-1] // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(region, dtype=torch.uint8)
    return [arena[offset : offset + nbytes] for offset, nbytes in zip(offsets[:-1], sizes, strict=True)]


def _file_mappings() -> list[tuple[int, int]]:
    """[start, end) of this process's private mappings of files (among them the checkpoints safetensors maps)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if (
                    len(fields) >= 6
                    and fields[5].startswith("/")
                    and fields[4] != "0"
                    and fields[1].endswith("p")
                ):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        return []
    return ranges


def release_file_pages(tensors: Sequence[Tensor]) -> int:
    """Drop the resident pages of those `tensors` that are views of a file mapping, once their bytes were copied
    (`huge_page_copies`): otherwise the checkpoint's pages read by the copy stay in the process's memory beside it.
    Only whole pages inside one tensor are dropped (MADV_DONTNEED: a private file mapping's untouched page is read
    from the file again if ever used); heap and anonymous memory are never touched. The bytes released."""
    libc_name = ctypes.util.find_library("c")
    mappings = _file_mappings()
    if libc_name is None or not mappings:
        return 0
    libc = ctypes.CDLL(libc_name)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for tensor in tensors:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not any(lo <= start and end <= hi for lo, hi in mappings):
            continue
        first, last = -(-start // _PAGE_BYTES) * _PAGE_BYTES, end // _PAGE_BYTES * _PAGE_BYTES
        if last > first and libc.madvise(first, last - first, _MADV_DONTNEED) == 0:
            released += last - first
    return released
