"""Smoke test of tools/bench_afd.py: a tiny random Llama through the plain engine and through AFD (one attention
rank, one FFN worker) gives the same greedy tokens (the tool exits 1 otherwise) and the table's three rows."""

from __future__ import annotations

import re

import pytest
from tool_scripts import load_tool, table_cells

bench = load_tool("bench_afd.py")


def test_tiny_run_prints_the_plain_and_afd_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 0 (same tokens both ways), and a row with numbers for each engine: tokens/s, ms per forward, and
    AFD's split of a layer."""
    args = ["--hidden-size", "128", "--num-layers", "2", "--num-prompts", "2", "--prompt-len", "8"]
    assert bench.main([*args, "--output-len", "4"]) == 0
    out = capsys.readouterr().out
    header = (
        "| engine | tokens/s | ms/forward | attention side ms/layer | FFN MLP ms/layer | exchange ms/layer |"
    )
    assert header in out, out
    rows = {
        cells[0]: cells[1:]
        for line in out.splitlines()
        if line.startswith(("| plain", "| AFD"))
        for cells in [table_cells(line)]
    }
    names = list(rows)  # plain with torch's threads, plain with 1, AFD
    assert len(names) == 3 and names[0].startswith("plain, "), rows
    assert names[1:] == ["plain, 1 thread", "AFD 1+1"], rows
    for name, cells in rows.items():
        assert float(cells[0]) > 0 and float(cells[1]) > 0, (name, cells)
    assert all(float(c) >= 0 for c in rows["AFD 1+1"][2:]), rows
    assert "model: random Llama, hidden 128, MLP 512, 2 layers, float32" in out
    assert re.search(r"AFD / plain tokens/s: \d+\.\d\dx \(\d+ threads\), \d+\.\d\dx \(1 thread\)", out), out
