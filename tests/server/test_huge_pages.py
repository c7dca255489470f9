"""loader/huge_pages.py: the quantized blocks' copy into one huge-page region, and the release of the checkpoint's
file pages the copy read; a fused weight's runs placed in such memory."""

from __future__ import annotations

from pathlib import Path

import torch
from pagoda.pagedkernel.quant import GGMLType
from pagoda.pagedkernel.quant.quantize import quantize
from pagoda.server.loader.huge_pages import huge_page_copies, release_file_pages, transparent_huge_pages
from pagoda.server.models.quantized import QuantizedWeight, run_bytes, run_copies, runs_of
from safetensors import safe_open
from safetensors.torch import save_file


def test_copies_share_one_aligned_region_and_keep_the_values() -> None:
    """Tensors of 2 MiB or more in all are copied (equal values, new memory, each on a cache line); a smaller set
    is not (None)."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 255, (n,), generator=gen, dtype=torch.uint8) for n in (3 << 20, 1001, 77)]
    tensors.append(torch.randn(33, 65, generator=gen))
    copies = huge_page_copies(tensors)
    if not transparent_huge_pages():
        assert copies is None
        return
    assert copies is not None and len(copies) == len(tensors)
    for original, copy in zip(tensors, copies, strict=True):
        assert torch.equal(copy, original) and copy.dtype == original.dtype
        assert copy.data_ptr() != original.data_ptr() and copy.data_ptr() % 64 == 0
    assert huge_page_copies([torch.ones(10), torch.zeros(3)]) is None


def test_release_drops_only_file_pages_and_the_values_read_back(tmp_path: Path) -> None:
    """A tensor memory-mapped from a safetensors file gives up its pages (and reads the same values again, from
    the file); heap tensors are never touched."""
    values = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    save_file({"blocks": values}, str(tmp_path / "w.safetensors"))
    handle = safe_open(str(tmp_path / "w.safetensors"), framework="pt", device="cpu")
    mapped: torch.Tensor = handle.get_tensor("blocks")  # type: ignore[no-untyped-call]
    assert torch.equal(mapped, values)  # every page touched
    heap = values.clone()
    assert release_file_pages([heap]) == 0
    assert release_file_pages([mapped]) > 0
    assert torch.equal(mapped, values) and torch.equal(heap, values)


def test_runs_placed_in_a_region_equal_the_concatenated_weight() -> None:
    """A fused weight's parts copied straight into region memory (the loader's one batched copy) give the same runs,
    bytes and products as the concatenating `QuantizedWeight.of`: q and k of one block type merge, v of another
    stays its own run."""
    gen = torch.Generator().manual_seed(2)
    q, k = (quantize(torch.randn(n, 64, generator=gen), GGMLType.Q8_0) for n in (48, 16))
    v = quantize(torch.randn(16, 64, generator=gen), GGMLType.Q4_1)
    concatenated = QuantizedWeight.of([q, k, v])
    runs = runs_of([q, k, v])
    assert [len(run) for run in runs] == [2, 1]
    memory = [torch.empty(run_bytes(run), dtype=torch.uint8) for run in runs]
    pairs = [pair for run, place in zip(runs, memory, strict=True) for pair in run_copies(run, place)]
    torch._foreach_copy_([dest for dest, _ in pairs], [source for _, source in pairs])
    placed = QuantizedWeight.placed(runs, memory)
    assert (
        [part.shape for part in placed.parts]
        == [part.shape for part in concatenated.parts]
        == [
            (64, 64),
            (16, 64),
        ]
    )
    for ours, theirs, region in zip(placed.parts, concatenated.parts, memory, strict=True):
        assert torch.equal(ours.data.reshape(-1), theirs.data.reshape(-1)) and ours.qtype == theirs.qtype
        assert ours.data.data_ptr() == region.data_ptr()  # in the given memory, not a copy of it
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(placed.matmul(x), concatenated.matmul(x))
