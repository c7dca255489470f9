"""Smoke test of tools/bench_kv_tiers.py on the tiny Llama: every run in the table, the tiers' hit rate above the
small pool's, the restart line, and the PNG."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tool_scripts import table_cells

ROOT = Path(__file__).resolve().parents[2]


def test_bench_kv_tiers_reports_every_run(tmp_path: Path) -> None:
    png = tmp_path / "tiers.png"
    args = [
        "--model",
        "tiny",
        "--conversations",
        "4",
        "--turns",
        "3",
        "--dtype",
        "float32",
        "--png",
        str(png),
    ]
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_kv_tiers.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines():
        cells = table_cells(line)
        if len(cells) == 6 and cells[1][:1].isdigit():
            rows[cells[0]] = float(cells[1])
    assert set(rows) == {"none", "host tier", "disk tier", "ideal (pool holds all)"}, done.stdout
    # The small pool loses conversations' histories; the host tier keeps all of them (the ideal's hit rate).
    assert rows["host tier"] > rows["none"] and rows["host tier"] == rows["ideal (pool holds all)"]
    assert rows["disk tier"] > rows["none"]
    assert "Restart with the disk tier" in done.stdout and "hit rate" in done.stdout
    assert png.stat().st_size > 1000
