"""tools/bench_embed.py: its workload, and a run on a tiny model (Pagoda only: the vLLM peer is not installed in
CI), whose numbers and JSON are complete."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tool_scripts import load_tool

bench = load_tool("bench_embed.py")


def test_inputs_are_fixed_by_the_seed_and_within_the_lengths() -> None:
    """Same seed, same inputs; lengths in range, BOS first."""
    a = bench.make_inputs(20, 5, 9, 300, 2, seed=3)
    assert a == bench.make_inputs(20, 5, 9, 300, 2, seed=3)
    assert a != bench.make_inputs(20, 5, 9, 300, 2, seed=4)
    assert all(5 <= len(i) <= 9 and i[0] == 2 for i in a)


def test_mean_cosine() -> None:
    """Identical vectors give 1, opposite ones -1."""
    assert bench.mean_cosine([[1.0, 0.0]], [[2.0, 0.0]]) == pytest.approx(1.0)
    assert bench.mean_cosine([[1.0, 0.0]], [[-1.0, 0.0]]) == pytest.approx(-1.0)


def test_tiny_run_reports_throughput(tmp_path: Path) -> None:
    """A tiny Llama run reports inputs/s and tokens/s of every input, into --json too."""
    out = tmp_path / "embed.json"
    tiny = ["--tiny", "llama", "--num-inputs", "12", "--min-len", "4", "--max-len", "20", "--warmup", "2"]
    report = bench.main([*tiny, "--dtype", "float32", "--json", str(out)])
    (row,) = report["results"]
    assert row["system"] == "pagoda" and row["num_inputs"] == 12
    assert 12 * 4 <= row["num_tokens"] <= 12 * 20
    assert row["inputs_per_s"] > 0 and row["tokens_per_s"] > row["inputs_per_s"]
    assert json.loads(out.read_text())["results"][0]["num_inputs"] == 12
