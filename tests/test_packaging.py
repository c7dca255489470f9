"""Workspace-level tests: package layout and the torch-free import rule."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("blockalloc", "pagedkernel", "scheduler", "server")


@pytest.mark.parametrize("name", PACKAGES)
def test_package_layout(name: str) -> None:
    """Each package has its own versioned pyproject, README, src layout and py.typed, and no pagoda/__init__.py."""
    root = ROOT / "packages" / name
    with open(root / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["name"] == f"pagoda-{name}"
    assert project["version"]
    assert (root / "README.md").is_file()
    assert (root / "src" / "pagoda" / name / "py.typed").is_file()
    assert not (root / "src" / "pagoda" / "__init__.py").exists()


@pytest.mark.parametrize("name", ["blockalloc", "scheduler"])
def test_imports_without_torch(name: str) -> None:
    """Importing blockalloc or scheduler (every submodule) never imports torch."""
    forbidden = {"torch", "numpy", "triton", "cupy", "transformers"}
    if name == "scheduler":
        forbidden |= {"pagoda.blockalloc", "pagoda.pagedkernel", "pagoda.server"}
    code = (
        "import importlib, pkgutil, sys\n"
        f"import pagoda.{name} as pkg\n"
        "for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        f"forbidden = {sorted(forbidden)!r}\n"
        "bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in forbidden))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
