"""Smoke test of tools/bench_sampler.py: tiny sizes, every system timed, the table and the JSON written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_bench_sampler_quick(tmp_path: Path) -> None:
    """Two settings x two shapes, from a logits file: each point has every system's time and a table line."""
    logits_file = tmp_path / "logits.pt"
    torch.save(torch.randn(3, 5000) * 4, logits_file)
    out = tmp_path / "bench.json"
    args = [
        "--setting",
        "t1",
        "topp",
        "--rows",
        "1",
        "4",
        "--vocab",
        "2000",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_sampler.py"), *args, "--logits-file", str(logits_file)],
        check=True,
        capture_output=True,
        text=True,
    )
    points = json.loads(out.read_text())
    assert [(p["setting"], p["rows"]) for p in points] == [("t1", 1), ("t1", 4), ("topp", 1), ("topp", 4)]
    for p in points:
        assert set(p["ms"]) == {"amax", "greedy", "cpu", "torch", "server"}
        assert all(ms is not None and ms > 0 for ms in p["ms"].values())
    lines = result.stdout.splitlines()
    assert "threads" in lines[0] and "cpu/greedy" in lines[1]
    assert len(lines) == 3 + len(points)
