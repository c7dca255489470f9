"""The scheduler's modules import each other without a cycle, counting imports under TYPE_CHECKING too."""

from __future__ import annotations

import ast
import graphlib
import importlib.util
import pkgutil
from pathlib import Path

import pagoda.scheduler


def internal_imports(source: str) -> set[str]:
    """Every `pagoda.scheduler.*` module that `source` imports, wherever the import statement stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("pagoda.scheduler.")}


def test_module_imports_form_no_cycle() -> None:
    """A topological order exists; protocols.py (below request.py) precedes policy.py (above it)."""
    graph: dict[str, set[str]] = {}
    for module in pkgutil.walk_packages(pagoda.scheduler.__path__, "pagoda.scheduler."):
        spec = importlib.util.find_spec(module.name)
        assert spec is not None and spec.origin is not None
        graph[module.name] = internal_imports(Path(spec.origin).read_text())
    assert "pagoda.scheduler.testing.sim" in graph  # the walk reaches the subpackage
    assert "pagoda.scheduler.protocols" in graph["pagoda.scheduler.request"]
    order = list(graphlib.TopologicalSorter(graph).static_order())  # CycleError names the cycle
    assert order.index("pagoda.scheduler.protocols") < order.index("pagoda.scheduler.policy")
