"""Smoke test of tools/bench_kernels.py: its CPU path on a tiny shape prints the table and writes the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_kernels_cpu_quick(tmp_path: Path) -> None:
    """Every op row has a time, a bandwidth and its ratio to the measured copy bandwidth."""
    out = tmp_path / "bench.json"
    script = str(ROOT / "tools" / "bench_kernels.py")
    result = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--quick", "--repeats", "2", "--json", str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    assert "copy bandwidth" in result.stdout
    data = json.loads(out.read_text())
    assert data["copy_gb_per_s"] > 0
    rows = data["rows"]
    assert {(r["op"], r["backend"]) for r in rows} == {("decode", "torch"), ("prefill", "torch")}
    for r in rows:
        assert r["ms"] > 0 and r["gb_per_s"] > 0
        assert abs(r["of_copy"] - r["gb_per_s"] / data["copy_gb_per_s"]) < 1e-9
        assert r["op"] in result.stdout
