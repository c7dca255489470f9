"""The GGUF conversion cache on disk (issue 28 item 9): private folders and files, and a damaged cached
`model.safetensors` (truncated, bad header) is an error naming the folder to delete, never a traceback."""

from __future__ import annotations

import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pagoda.pagedkernel.cpu_backend import CpuBackend
from pagoda.server.cli import main
from pagoda.server.config import EngineConfig
from pagoda.server.engine.setup import build_parts
from pagoda.server.loader import WeightLoadError, cache_folder, load_model
from transformers import PreTrainedModel

CPU = torch.device("cpu")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_conversion_is_private(tiny_gguf: tuple[Path, PreTrainedModel], tmp_path: Path) -> None:
    """The cache root and the converted folder are 0700, every converted file 0600 (no world-readable weights)."""
    gguf_path, _ = tiny_gguf
    root = tmp_path / "new" / "cache"
    folder = load_model(str(gguf_path), dtype=torch.float32, device=CPU, cache_dir=root).model_path
    assert folder.parent == root
    assert _mode(root) == 0o700 and _mode(folder) == 0o700
    files = list(folder.iterdir())
    assert any(p.name == "model.safetensors" for p in files)
    assert {p.name: _mode(p) for p in files} == {p.name: 0o600 for p in files}


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _bad_header(path: Path) -> None:
    path.write_bytes(b"\xff" * 8 + b"{not a header" + b"\0" * 64)


@pytest.mark.parametrize("damage", [_truncate, _bad_header], ids=["truncated", "bad-header"])
def test_damaged_cached_conversion_names_the_folder_to_delete(
    tiny_gguf: tuple[Path, PreTrainedModel], tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    """A cache hit whose safetensors file is damaged raises WeightLoadError naming the cache folder and saying
    to delete it; once deleted, the next load converts again and works."""
    gguf_path, _ = tiny_gguf
    root = tmp_path / "cache"
    folder = load_model(str(gguf_path), dtype=torch.float32, device=CPU, cache_dir=root).model_path
    damage(folder / "model.safetensors")
    with pytest.raises(WeightLoadError) as info:
        load_model(str(gguf_path), dtype=torch.float32, device=CPU, cache_dir=root)
    message = str(info.value)
    assert f"delete the folder {cache_folder(gguf_path, root)}" in message and "damaged" in message
    shutil.rmtree(folder)
    assert load_model(str(gguf_path), dtype=torch.float32, device=CPU, cache_dir=root).model_path == folder


def test_damaged_weights_are_a_clear_serve_error(
    tiny_model_path: Callable[[str], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`pagoda serve` on a folder with a truncated model.safetensors exits 1 with one line naming the folder."""
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")  # serve sets these: keep them test-local
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "256")
    folder = shutil.copytree(tiny_model_path("llama"), tmp_path / "model")
    _truncate(folder / "model.safetensors")
    status = main(["serve", str(folder), "--dtype", "float32", "--kv-cache-gib", "0.05", "--port", "1"])
    err = capsys.readouterr().err
    assert status == 1
    assert "cannot start" in err and f"delete the folder {folder}" in err
    assert "Traceback" not in err


def test_kernels_of_the_engine_dtype_are_built_at_start_up(tiny_model_path: Callable[[str], Path]) -> None:
    """A bfloat16 engine on the cpu backend has its bfloat16 kernels loaded once built, before any step runs
    (the first forward does not wait for the compiler)."""
    config = EngineConfig.from_flat(
        model=str(tiny_model_path("llama")), dtype="bfloat16", kernel_backend="cpu", num_kv_blocks=32
    )
    parts = build_parts(config)
    assert isinstance(parts.backend, CpuBackend)
    assert torch.bfloat16 in parts.backend.loaded_dtypes()
    assert parts.backend.kernels(torch.bfloat16) is not None
