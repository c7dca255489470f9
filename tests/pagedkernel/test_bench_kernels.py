"""Smoke test of tools/bench_kernels.py: its CPU path on a tiny shape prints the table and writes the JSON."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_bench_kernels_cpu_quick(tmp_path: Path) -> None:
    """Every op row has a time, a bandwidth and its ratio to the measured copy bandwidth."""
    out = tmp_path / "bench.json"
    script = str(ROOT / "tools" / "bench_kernels.py")
    args = [
        "--device",
        "cpu",
        "--quick",
        "--repeats",
        "2",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "bench.png"),
    ]
    result = subprocess.run(
        [sys.executable, script, *args],
        check=True,
        capture_output=True,
        text=True,
    )
    assert "copy bandwidth" in result.stdout
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
    data = json.loads(out.read_text())
    assert data["copy_gb_per_s"] > 0
    rows = data["rows"]
    assert {(r["op"], r["backend"]) for r in rows} == {
        (op, backend) for op in ("decode", "prefill") for backend in ("torch", "cpu")
    }
    for r in rows:
        assert r["ms"] > 0 and r["gb_per_s"] > 0
        assert abs(r["of_copy"] - r["gb_per_s"] / data["copy_gb_per_s"]) < 1e-9
        assert r["op"] in result.stdout


def test_failed_points_show_in_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend that ran out of memory or raised shows OOM / ERR in its row instead of numbers."""
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "tools" / "bench_kernels.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_kernels", bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    rows = [
        bench.Row("decode", "torch", 1, 8, 1, None, None, None, None, "OOM"),
        bench.Row("decode", "cupy", 1, 8, 1, None, None, None, None, "RuntimeError: boom"),
        bench.Row("decode", "triton", 1, 8, 1, 2.0, 3.0, 0.5, 0.1, None),
    ]
    lines = bench.format_table(rows, 6.0, torch.device("cpu")).splitlines()
    assert "OOM" in lines[2] and "ERR" in lines[3] and "50.0%" in lines[4]
