"""Smoke test of tools/bench_fused_head.py --tiny: tiny random Q8_0 GGUF models' LM heads, fused against unfused,
in both tables."""

from __future__ import annotations

import pytest
import torch
from tool_scripts import load_tool, table_cells

bench = load_tool("bench_fused_head.py")


def _rows(out: str, label: str) -> list[list[str]]:
    """The cells of the table rows of model `label`."""
    return [table_cells(line) for line in out.splitlines() if line.startswith(f"| {label} |")]


def test_tiny_models_fill_both_tables(capsys: pytest.CaptureFixture[str]) -> None:
    """Per model, rows count and mode: the op's times and the same tokens fused and unfused; then the engine's
    wall time per step with the fused head on and off, the same tokens both ways."""
    threads = torch.get_num_threads()
    args = [
        "--tiny",
        "llama",
        "gemma3",
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--rows",
        "1",
        "--repeats",
        "2",
    ]
    try:
        assert bench.main([*args, "--engine-steps", "2", "--engine-rounds", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "| model | vocab | LM head | rows | mode | unfused | fused | speed-up | same tokens |" in out, out
    assert "| model | rows | mode | wall per step, unfused | fused | speed-up | same tokens |" in out, out
    for label in ("tiny llama", "tiny gemma3"):
        rows = _rows(out, label)
        op, engine = rows[:3], rows[3:]
        assert [r[4] for r in op] == ["greedy", "T = 1.0", "T = 1.0, top_p 0.9"], out
        assert [r[2] for r in engine] == ["greedy", "T = 1.0", "T = 1.0, top_p 0.9"], out
        for cells in op:  # vocab, LM head, rows, mode, unfused, fused, speed-up, same tokens
            assert cells[1] == "400" and cells[2].startswith("Q8_0") and cells[3] == "1", cells
            assert float(cells[5].removesuffix(" ms")) > 0 and float(cells[6].removesuffix(" ms")) > 0, cells
            assert cells[7].endswith("x") and cells[8] == "yes", cells
        for cells in engine:  # rows, mode, unfused, fused, speed-up, same tokens, rows sampled unfused
            assert cells[1] == "1" and float(cells[3].removesuffix(" ms")) > 0, cells
            assert float(cells[4].removesuffix(" ms")) > 0 and cells[6] == "yes", cells
