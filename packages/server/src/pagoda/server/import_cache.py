"""Two disk caches that take transformers' slowest imports out of a server's start (about 2.5 s on a 2-core Xeon).

- `import transformers` (5.x) reads every one of its ~1,700 model source files to learn which names each exports
  (`define_import_structure`), and the first import under `transformers.models` (a config class, the tokenizer)
  does it again under another cache key. The result depends only on those files: it is kept in a JSON file keyed
  by the folder's path and modification times, and transformers reads that instead.
- Every model config class imports `transformers.utils.type_validators`, which imports `transformers.activations`
  only to check `hidden_act` against its table's names; that module pulls in transformers' checkpoint conversion,
  accelerate, FSDP, DTensor and sympy (half of the config's load). The validators get a stand-in table whose names
  come from a cache (written the first time the real table is imported); looking an activation up in it imports
  the real module. Pagoda's models never use transformers' activations, so a server never imports them.

`install()` (called first thing by `pagoda serve` and the engine-core processes) puts a finder in front of the
import system that does both as those two transformers modules load, then removes itself. Caches are JSON, never
pickle (data, never code), in a private folder; a transformers without these functions, or any cache error, leaves
its imports as they are.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

IMPORT_UTILS = "transformers.utils.import_utils"
VALIDATORS = "transformers.utils.type_validators"
ACTIVATIONS = "transformers.activations"
_FORMAT = 1  # part of every key: bump when a cache file's layout changes

# transformers' import structure: {frozenset(backends): {module: set(names)}}
ImportStructure = dict[frozenset[str], dict[str, set[str]]]


def cache_folder() -> Path:
    """$XDG_CACHE_HOME (or ~/.cache)/pagoda/import-structure."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagoda" / "import-structure"


def install(folder: Path | None = None) -> bool:
    """Put the caching finder in front of the import system (caches in `folder`, default `cache_folder()`); False
    when transformers is already imported (too late), not installed, or the finder is already there."""
    if IMPORT_UTILS in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return False
    if importlib.machinery.PathFinder.find_spec("transformers") is None:
        return False
    sys.meta_path.insert(0, _Finder(cache_folder() if folder is None else folder))
    return True


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the two transformers modules as usual and hands each to its caching loader; leaves once both are
    loaded."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.pending = {IMPORT_UTILS: _StructureLoader, VALIDATORS: _ValidatorsLoader}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """The normal spec with a caching loader for the two modules; None (not ours) for every other module."""
        loader_type = self.pending.pop(fullname, None)
        if loader_type is None:
            return None
        if not self.pending:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            spec.loader = loader_type(spec.loader.name, spec.loader.path, self.folder)
        return spec


class _CachingLoader(importlib.machinery.SourceFileLoader):
    """transformers' own source loader, knowing the cache folder."""

    def __init__(self, fullname: str, path: str, folder: Path) -> None:
        super().__init__(fullname, path)
        self.folder = folder


class _StructureLoader(_CachingLoader):
    """import_utils as usual, then its `define_import_structure` answered from the cache for the models folder."""

    def exec_module(self, module: ModuleType) -> None:
        """Execute import_utils, then wrap its scan."""
        super().exec_module(module)
        scan = getattr(module, "define_import_structure", None)
        if callable(scan):
            models = Path(self.path).resolve().parent.parent / "models"
            module.define_import_structure = cached_scan(scan, models, self.folder)  # type: ignore[attr-defined]


class _ValidatorsLoader(_CachingLoader):
    """type_validators executed against a stand-in activations table when its names are cached; otherwise as
    usual, caching the real table's names for the next process."""

    def exec_module(self, module: ModuleType) -> None:
        """Execute type_validators with `transformers.activations` standing in, or record the real table's names."""
        source = Path(self.path).resolve().parent.parent / "activations.py"
        key = _stamp_key(source)
        names = _read_json(self.folder / "transformers-activations.json", key)
        if ACTIVATIONS in sys.modules or not isinstance(names, list):
            super().exec_module(module)
            table = getattr(module, "ACT2FN", None)
            if isinstance(table, Mapping) and table:
                with contextlib.suppress(OSError, TypeError, ValueError):
                    _write_json(self.folder / "transformers-activations.json", key, sorted(map(str, table)))
            return
        stand_in = ModuleType(ACTIVATIONS)
        stand_in.ACT2FN = ActivationNames(tuple(map(str, names)))  # type: ignore[attr-defined]
        sys.modules[ACTIVATIONS] = stand_in
        try:
            super().exec_module(module)
        finally:
            # Only type_validators saw the stand-in: the next import of the name loads the real module.
            if sys.modules.get(ACTIVATIONS) is stand_in:
                del sys.modules[ACTIVATIONS]


class ActivationNames(Mapping[str, Any]):
    """transformers' activation table as far as a validator needs it: its names; a lookup imports the real one."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._names = frozenset(names)

    def __contains__(self, key: object) -> bool:
        """Whether `key` names an activation."""
        return key in self._names

    def __iter__(self) -> Iterator[str]:
        """The names, sorted."""
        return iter(sorted(self._names))

    def __len__(self) -> int:
        """How many activations there are."""
        return len(self._names)

    def __getitem__(self, key: str) -> Any:
        """The real activation (imports transformers.activations)."""
        table: Mapping[str, Any] = importlib.import_module(ACTIVATIONS).ACT2FN
        return table[key]


def cached_scan(scan: Callable[..., Any], models: Path, folder: Path) -> Callable[..., Any]:
    """`scan` (transformers' define_import_structure), answered from the cache in `folder` when asked for the
    `models` folder or a file directly in it (transformers scans a file's folder), scanned otherwise. Memoized
    per argument like transformers' own (its callers update the structure they get back, in place)."""

    @functools.lru_cache
    def scan_cached(module_path: Any, prefix: str | None = None) -> Any:
        path = Path(module_path)
        if (path if path.is_dir() else path.parent).resolve() != models:
            return scan(module_path, prefix)
        file = folder / f"transformers-models-{prefix or 'none'}.json"
        key = _folder_key(models, prefix)
        stored = _read_json(file, key)
        if isinstance(stored, list):
            with contextlib.suppress(TypeError, ValueError):
                return {
                    frozenset(backends): {m: set(n) for m, n in mods.items()} for backends, mods in stored
                }
        structure = scan(module_path, prefix)
        rows = [[sorted(b), {m: sorted(n) for m, n in mods.items()}] for b, mods in structure.items()]
        with contextlib.suppress(OSError, TypeError, ValueError):
            _write_json(file, key, rows)
        return structure

    return scan_cached


def _folder_key(models: Path, prefix: str | None) -> str:
    """The scan's key: the folder and the modification times of it and its subfolders (a model added, removed or
    edited in place under an editable install changes one of them)."""
    stamps = [str(models.stat().st_mtime_ns)]
    with os.scandir(models) as entries:
        stamps += sorted(f"{e.name}:{e.stat().st_mtime_ns}" for e in entries if e.is_dir())
    return json.dumps([_FORMAT, str(models), prefix, stamps])


def _stamp_key(source: Path) -> str:
    """A file's key: its path, size and modification time (missing: a key no cache matches)."""
    try:
        info = source.stat()
    except OSError:
        return json.dumps([_FORMAT, str(source), None])
    return json.dumps([_FORMAT, str(source), info.st_size, info.st_mtime_ns])


def _read_json(path: Path, key: str) -> object:
    """The value stored under `key` in `path`, or None (missing, stale, not private to this user, unreadable)."""
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
        return data.get("value") if isinstance(data, dict) and data.get("key") == key else None
    except (OSError, ValueError):
        return None


def _write_json(path: Path, key: str, value: object) -> None:
    """Store `value` under `key`: a private folder, the file written whole then renamed into place."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=".cache-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump({"key": key, "value": value}, out)
        os.replace(scratch, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(scratch)
        raise
