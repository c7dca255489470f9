"""Smoke test of tools/bench_kv_capacity.py: hybrid off, on and on + int8 in the table and the PNG, simulator and
a tiny `--engine` run on a tiny sliding-window model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pagoda.server.testing import make_tiny_model
from tool_scripts import table_cells

ROOT = Path(__file__).resolve().parents[2]


def _rows(stdout: str) -> dict[str, list[str]]:
    """The capacity table's rows by configuration name."""
    rows = {}
    for line in stdout.splitlines():
        cells = table_cells(line)
        if cells and cells[0].startswith("hybrid"):
            rows[cells[0]] = cells[1:]
    return rows


def test_bench_kv_capacity_reports_three_configurations(tmp_path: Path) -> None:
    """int8 KV holds more blocks than bfloat16 at the same --kv-cache-gib, hybrid or not, and the engine runs
    each configuration (sequences at once, tok/s, TPOT measured)."""
    model = make_tiny_model("gemma3", tmp_path / "gemma3")
    png = tmp_path / "capacity.png"
    args = ["--model", str(model), "--kv-cache-gib", "0.002", "--prompt-len", "96", "--max-tokens", "4"]
    args += [
        "--num-prompts",
        "3",
        "--max-num-batched-tokens",
        "256",
        "--lengths",
        "128",
        "512",
        "--out",
        str(png),
    ]
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_kv_capacity.py"), *args, "--engine"],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    rows = _rows(result.stdout)
    assert set(rows) == {"hybrid off", "hybrid on", "hybrid on + int8"}, result.stdout
    blocks = {name: int(cells[0]) for name, cells in rows.items()}
    assert blocks["hybrid on + int8"] > blocks["hybrid on"], blocks
    for cells in rows.values():
        # blocks, steady bound, at once (simulator), vs off, at once (engine), tok/s, TPOT
        assert 1 <= int(cells[2]) <= float(cells[1]) and int(cells[4]) >= 1, rows
        assert cells[3].endswith("x") and cells[5] != "-" and cells[6] != "-", rows
    assert "| hybrid on + int8 | ratio on | ratio on + int8 |" in result.stdout  # the per-length cost table
    assert png.read_bytes().startswith(b"\x89PNG")
