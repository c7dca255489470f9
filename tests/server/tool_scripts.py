"""Load a script of tools/ (not a package) as a module, for the tests of that tool."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(filename: str) -> ModuleType:
    """tools/`filename` as a module, registered in sys.modules so that its dataclasses resolve; tools/ joins
    sys.path, as it does when a tool runs as a script, so that tools importing each other by name load."""
    if str(TOOLS) not in sys.path:
        sys.path.append(str(TOOLS))
    spec = importlib.util.spec_from_file_location(f"pagoda_tool_{Path(filename).stem}", TOOLS / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def table_cells(line: str) -> list[str]:
    """The stripped cells of one Markdown table row (`| a | b |` -> ["a", "b"]), as the tools print them."""
    return [c.strip() for c in line.strip().strip("|").split("|")]
