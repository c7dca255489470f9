"""The GGUF conversion cache is never trusted blindly (issue 43 item 8): a cache root or a cached folder (or a
file in it) that another user could have written is refused by the loader and by `pagoda serve` (exit 2, one
line naming the path and the fix), so nobody can plant weights, a tokenizer or a chat template there."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pagoda.server.cli import main
from pagoda.server.loader import UntrustedCacheError, cache_folder, load_model
from transformers import PreTrainedModel

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _onednn_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")  # serve sets these: keep them test-local
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "256")


@pytest.fixture(scope="module")
def converted(tiny_gguf: tuple[Path, PreTrainedModel], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A genuine conversion of the tiny GGUF, in a root of its own: what a planter would copy in."""
    root = tmp_path_factory.mktemp("genuine")
    return load_model(str(tiny_gguf[0]), dtype=torch.float32, device=CPU, cache_dir=root).model_path


def _plant(gguf_path: Path, root: Path, genuine: Path, folder_mode: int, file_mode: int) -> Path:
    """Put a conversion where `gguf_path`'s cache folder is predicted to be, with the given modes."""
    root.mkdir(mode=0o700, exist_ok=True)
    root.chmod(0o700)
    target = shutil.copytree(genuine, cache_folder(gguf_path, root))
    for path in target.iterdir():
        path.chmod(file_mode)
    target.chmod(folder_mode)
    return target


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A port in use, so that a server that wrongly got past its checks fails to bind instead of serving on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def _serve(model: Path, capsys: pytest.CaptureFixture[str], busy_port: int) -> tuple[int, str]:
    status = main(
        ["serve", str(model), "--dtype", "float32", "--kv-cache-gib", "0.05", "--port", str(busy_port)]
    )
    return status, capsys.readouterr().err


def test_a_shared_writable_root_is_refused(
    tiny_gguf: tuple[Path, PreTrainedModel],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    busy_port: int,
) -> None:
    """$PAGODA_CACHE_DIR writable by group and others: serve exits 2 naming it; the loader raises."""
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(root))
    status, err = _serve(tiny_gguf[0], capsys, busy_port)
    assert status == 2, err
    assert f"the GGUF cache {root} is not private" in err and "chmod 700" in err and "Traceback" not in err
    with pytest.raises(UntrustedCacheError):
        load_model(str(tiny_gguf[0]), dtype=torch.float32, device=CPU, cache_dir=root)
    assert list(root.iterdir()) == []  # nothing converted into it


@pytest.mark.parametrize(
    ("folder_mode", "file_mode"), [(0o777, 0o600), (0o700, 0o666)], ids=["folder", "file"]
)
def test_a_planted_folder_is_never_loaded(
    tiny_gguf: tuple[Path, PreTrainedModel],
    converted: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    folder_mode: int,
    file_mode: int,
    busy_port: int,
) -> None:
    """A complete conversion planted at the predictable name, writable by others (the folder, or one file):
    serve exits 2 naming the folder to delete, and the loader refuses it (LLM and engine alike)."""
    root = tmp_path / "cache"
    target = _plant(tiny_gguf[0], root, converted, folder_mode, file_mode)
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(root))
    status, err = _serve(tiny_gguf[0], capsys, busy_port)
    assert status == 2, err
    assert f"the cached conversion {target} is not private" in err and f"delete the folder {target}" in err
    with pytest.raises(UntrustedCacheError, match="writable by others"):
        load_model(str(tiny_gguf[0]), dtype=torch.float32, device=CPU, cache_dir=root)


def test_a_private_conversion_is_still_a_cache_hit(
    tiny_gguf: tuple[Path, PreTrainedModel], converted: Path, tmp_path: Path
) -> None:
    """This user's own 0700/0600 conversion loads as before (the checks refuse others' folders only)."""
    root = tmp_path / "cache"
    target = _plant(tiny_gguf[0], root, converted, 0o700, 0o600)
    loaded = load_model(str(tiny_gguf[0]), dtype=torch.float32, device=CPU, cache_dir=root)
    assert loaded.model_path == target
