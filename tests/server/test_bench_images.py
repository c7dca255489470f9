"""Smoke test of tools/bench_images.py --tiny: the tests' tiny Llava served and measured once per scenario, the
engine alone on one image, the table and the PNG."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tool_scripts import load_tool, table_cells

bench = load_tool("bench_images.py")


def test_tiny_llava_table_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One Pagoda row with every TTFT and rate measured, the vision encoder's share of the engine alone, and the
    TTFT plot written."""
    png = tmp_path / "images.png"
    args = ["--tiny", "--dtype", "float32", "--requests", "1", "--concurrency", "1", "--repeats", "1"]
    args += ["--max-tokens", "2", "--temperatures", "0", "--encoder-images", "1", "--png", str(png)]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "llava tiny (random weights, 448 px PNGs sent), 2 output tokens;" in out, out
    assert "| server | temp | 1 stream TTFT ms (median) | 1 stream images/s |" in out, out
    (row,) = [line for line in out.splitlines() if line.startswith("| pagoda |")]
    cells = table_cells(row)
    # temp, 1 stream TTFT, images/s, concurrent TTFT median / p90, images/s, TTFT miss, TTFT hit
    assert cells[1] == "0" and len(cells) == 8, row
    numbers = [cells[2], cells[3], *cells[4].split(" / "), cells[5], cells[6], cells[7]]
    assert all(float(n) >= 0 for n in numbers) and float(cells[3]) > 0 and float(cells[5]) > 0, row
    split = re.search(
        r"1 images one at a time \(prompt \+ 1 token\): vision encoder (\d+) ms per image, language model and the "
        r"rest (\d+) ms \((\d+)% in the encoder\)",
        out,
    )
    assert split, out
    assert png.read_bytes().startswith(b"\x89PNG")
