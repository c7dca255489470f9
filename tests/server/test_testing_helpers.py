"""pagoda.server.testing: the serve-and-wait helper on a tiny model, and where the package may be imported from."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest
from pagoda.server.testing import LiveServer, ServerStartError
from tool_scripts import load_tool

ROOT = Path(__file__).resolve().parents[2]
SMALL = ("--kv-cache-gib", "0.05", "--dtype", "float32")  # the live tests' small KV cache


def _serve_children() -> list[psutil.Process]:
    """The `pagoda serve` processes this test process started that still run."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "pagoda.server.cli" in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def test_live_server_returns_once_health_is_200_and_stops_cleanly(
    tiny_model_path: Callable[[str], Path],
) -> None:
    """The constructor returns with /health at 200 and the model served; leaving the block SIGTERMs it (status 0)."""
    with LiveServer(tiny_model_path("llama"), SMALL, served_model_name="tiny-llama") as server:
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        models = httpx.get(f"{server.base_url}/v1/models").json()["data"]
        assert [model["id"] for model in models] == ["tiny-llama"]
        assert server.base_url == f"http://127.0.0.1:{server.port}"
    assert server.process.returncode == 0
    assert server.stop() == 0  # again: nothing left to stop


def test_live_server_that_exits_early_raises_with_its_log_tail(
    tiny_model_path: Callable[[str], Path],
) -> None:
    """A bad flag: the server exits before /health answers, and the error carries its status and output."""
    with pytest.raises(ServerStartError) as caught:
        LiveServer(tiny_model_path("llama"), ["--no-such-flag"])
    assert caught.value.returncode == 2  # argparse's usage error
    assert "unrecognized arguments: --no-such-flag" in caught.value.log_tail
    message = str(caught.value)
    assert "exited with status 2 before /health answered 200" in message
    assert "unrecognized arguments: --no-such-flag" in message
    assert _serve_children() == []


def test_live_server_past_its_deadline_is_stopped(tiny_model_path: Callable[[str], Path]) -> None:
    """No time to become healthy: the error says so (no exit status) and the process does not outlive it."""
    with pytest.raises(ServerStartError, match=r"did not answer /health with 200 within 0 s") as caught:
        LiveServer(tiny_model_path("llama"), SMALL, ready_timeout=0)
    assert caught.value.returncode is None
    assert _serve_children() == []


def test_bench_serving_launches_through_the_helper(tiny_model_path: Callable[[str], Path]) -> None:
    """bench_serving --serve's server: healthy and warmed up inside the block, stopped after it."""
    bench = load_tool("bench_serving.py")
    args = argparse.Namespace(serve_model=str(tiny_model_path("llama")))
    with bench.launched(args, " ".join(SMALL)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        assert len(_serve_children()) == 1
    assert _serve_children() == []


def _imports_of(path: Path) -> set[str]:
    """Every module that the file at `path` imports (`from a import b` counts as a and a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_production_code_never_imports_the_testing_package() -> None:
    """No module of the four packages outside pagoda.server.testing imports it, wherever the import stands."""
    testing = ROOT / "packages" / "server" / "src" / "pagoda" / "server" / "testing"
    for path in (ROOT / "packages").glob("*/src/pagoda/**/*.py"):
        if testing in path.parents:
            continue
        imported = _imports_of(path)
        assert not any(
            m == "pagoda.server.testing" or m.startswith("pagoda.server.testing.") for m in imported
        ), path


def test_importing_the_server_does_not_import_the_testing_package() -> None:
    """`import pagoda.server` and its entry points (CLI, LLM, the app) leave pagoda.server.testing unloaded."""
    code = (
        "import sys, pagoda.server, pagoda.server.cli, pagoda.server.llm, pagoda.server.api.app\n"
        "print(sorted(m for m in sys.modules if m.startswith('pagoda.server.testing')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert done.stdout.strip() == "[]"


def test_no_tool_reaches_into_tests() -> None:
    """Tools import helpers from packages: none edits sys.path or names the tests folder as a module source."""
    for path in (ROOT / "tools").glob("*.py"):
        text = path.read_text()
        assert "sys.path" not in text, path.name
        assert not any(
            m.startswith(("tiny_models", "api_fake_engine", "tests")) for m in _imports_of(path)
        ), path
