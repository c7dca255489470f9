"""pagoda.server.import_cache: transformers' model-folder scan and its activation table come from private JSON
caches, with exactly the structure transformers computes itself; a stale, foreign or broken cache is ignored; the
real activations still load when asked for; `pagoda serve` installs the caches before transformers is imported.

Each case runs in a fresh interpreter (the finder must be in place before transformers' first import)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pagoda.server.import_cache import _read_json, _write_json, cache_folder

# Prints the two scans transformers makes (as `import transformers` and `transformers.models` ask), as JSON, and
# how many times its own scanner ran (its lru_cache's misses).
SCANS = """
import json, sys
from pathlib import Path
{install}
import transformers
from transformers import LlamaConfig
from transformers.utils import import_utils as iu
models = Path(transformers.__file__).parent / "models"
def canon(s):
    return sorted([sorted(k), sorted((m, sorted(n)) for m, n in v.items())] for k, v in s.items())
print(json.dumps({{
    "models": canon(iu.define_import_structure(models, prefix="models")),
    "none": canon(iu.define_import_structure(str(models / "__init__.py"))),
    "scanned": iu.create_import_structure_from_path.cache_info().misses,
    "activations": "transformers.activations" in sys.modules,
    "dtensor": "torch.distributed.tensor" in sys.modules,
}}))
"""


def _run(code: str, folder: Path | None) -> dict[str, object]:
    """`code` in a fresh interpreter (with the caches in `folder`, or none installed); its JSON output."""
    install = (
        ""
        if folder is None
        else f"from pagoda.server.import_cache import install; assert install(Path({str(folder)!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code.format(install=install)], capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def plain() -> dict[str, object]:
    """transformers' own scans, without the caches."""
    return _run(SCANS, None)


@pytest.fixture(scope="module")
def warm_folder(tmp_path_factory: pytest.TempPathFactory, plain: dict[str, object]) -> Path:
    """A cache folder written by one cold run (whose scans equal transformers' own)."""
    folder = tmp_path_factory.mktemp("import-cache") / "cache"
    cold = _run(SCANS, folder)
    assert cold["models"] == plain["models"] and cold["none"] == plain["none"]
    assert cold["scanned"] == plain["scanned"]
    return folder


def test_cached_scans_equal_transformers_own_and_skip_the_scan(
    plain: dict[str, object], warm_folder: Path
) -> None:
    """Cold (the fixture): transformers scans and the caches are written (0600 in a 0700 folder); warm: its
    scanner does not read the models folder, the structures are the same, and a config imports neither the
    activations module nor DTensor."""
    warm = _run(SCANS, warm_folder)
    assert plain["models"] == warm["models"]
    assert plain["none"] == warm["none"]
    assert isinstance(plain["scanned"], int) and plain["scanned"] > 500  # every model folder, read
    # Warm, only the model packages imported (llama, auto) scan their own folder (a file or two each).
    assert isinstance(warm["scanned"], int) and warm["scanned"] < 10
    assert plain["activations"] and plain["dtensor"]  # what a config costs without the caches
    assert not warm["activations"] and not warm["dtensor"]
    files = sorted(p.name for p in warm_folder.iterdir())
    assert files == [
        "transformers-activations.json",
        "transformers-models-models.json",
        "transformers-models-none.json",
    ]
    assert warm_folder.stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in warm_folder.iterdir())


def test_a_stale_cache_is_ignored_and_rewritten(
    tmp_path: Path, plain: dict[str, object], warm_folder: Path
) -> None:
    """A scan cached under another key (another transformers) is not read: transformers scans, its structure
    is its own, and the file is rewritten under the right key."""
    folder = tmp_path / "cache"
    shutil.copytree(warm_folder, folder)
    models = folder / "transformers-models-models.json"
    data = json.loads(models.read_text())
    key = data["key"]
    models.write_text(json.dumps({"key": key.replace("models", "elsewhere"), "value": []}))
    again = _run(SCANS, folder)
    assert again["models"] == plain["models"] and again["none"] == plain["none"]
    assert isinstance(again["scanned"], int) and again["scanned"] > 500
    assert json.loads(models.read_text())["key"] == key


def test_a_foreign_or_broken_cache_file_is_not_read(tmp_path: Path) -> None:
    """A file others may write, a link, one under another key and one that is not JSON all read as missing."""
    path = tmp_path / "c.json"
    _write_json(path, "k", [1, 2])
    assert _read_json(path, "k") == [1, 2]
    assert _read_json(path, "other") is None
    path.chmod(0o620)
    assert _read_json(path, "k") is None
    path.chmod(0o600)
    link = tmp_path / "link.json"
    link.symlink_to(path)
    assert _read_json(link, "k") is None
    path.write_text("{not json")
    assert _read_json(path, "k") is None
    assert _read_json(tmp_path / "missing.json", "k") is None


def test_the_real_activations_load_when_asked_for(warm_folder: Path) -> None:
    """With the stand-in in place, the validators' table has the real table's names; importing
    transformers.activations (or looking an activation up) gives transformers' own classes."""
    folder = warm_folder
    code = """
import json, sys
from pathlib import Path
{install}
from transformers import LlamaConfig
LlamaConfig(hidden_act="silu")
from transformers.utils import type_validators as tv
from pagoda.server.import_cache import ActivationNames
stand_in = tv.ACT2FN
looked_up = stand_in["silu"]
from transformers.activations import ACT2FN, SiLUActivation
print(json.dumps({{
    "stand_in": isinstance(stand_in, ActivationNames),
    "names_equal": sorted(stand_in) == sorted(ACT2FN) and len(stand_in) == len(ACT2FN),
    "contains": ["silu" in stand_in, "no-such-activation" in stand_in],
    "looked_up_real": type(looked_up).__name__ == type(ACT2FN["silu"]).__name__,
    "real_module": type(ACT2FN).__name__,
}}))
"""
    result = _run(code, folder)
    assert result == {
        "stand_in": True,
        "names_equal": True,
        "contains": [True, False],
        "looked_up_real": True,
        "real_module": "ClassInstantier",
    }


def test_install_is_too_late_once_transformers_is_imported(tmp_path: Path) -> None:
    """install() says False (and changes nothing) when transformers' import_utils is already loaded."""
    code = """
import json, sys
from pathlib import Path
import transformers
from pagoda.server.import_cache import install, _Finder
first = install(Path({folder!r}))
print(json.dumps({{"installed": first, "finders": sum(isinstance(f, _Finder) for f in sys.meta_path)}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code.format(folder=str(tmp_path))], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == {"installed": False, "finders": 0}
    assert not any(tmp_path.iterdir())


def test_serve_installs_the_caches_before_importing_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pagoda serve` with a bad flag value (found after the imports) exits 2 naming it, and its imports wrote
    the scans' caches into $XDG_CACHE_HOME: the finder was in place before transformers' first import."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    command = [sys.executable, "-m", "pagoda.server.cli", "serve", "--max-num-seqs", "0"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "max-num-seqs" in result.stderr or "max_num_seqs" in result.stderr
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = cache_folder()
    assert folder == tmp_path / "pagoda" / "import-structure"
    # The scans' caches (the activation names come with the first config, which this start never reaches).
    assert sorted(p.name for p in folder.iterdir()) == [
        "transformers-models-models.json",
        "transformers-models-none.json",
    ]
