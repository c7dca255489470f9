"""Smoke test of tools/bench_rerank.py: a one-layer random cross-encoder scored by Pagoda, then by transformers on
the same pairs; the second run compares the two engines' scores."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tool_scripts import load_tool

bench = load_tool("bench_rerank.py")


def test_both_engines_score_the_same_pairs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each engine prints its rate and writes one score per document; transformers' run prints the largest
    difference from Pagoda's scores, which is float32 rounding."""
    args = [
        "--model-dir",
        str(tmp_path),
        "--layers",
        "1",
        "--num-docs",
        "3",
        "--repeats",
        "1",
        "--hf-batch",
        "2",
    ]
    for engine in ("pagoda", "transformers"):
        bench.main([*args, "--engine", engine])
        out = capsys.readouterr().out
        rate = re.search(rf"{engine}: 3 pairs, (\d+) tokens; seconds \[[\d., ]+\]; ([\d.]+) pairs/s", out)
        assert rate and int(rate[1]) > 3 * 60 and float(rate[2]) > 0, out
    diff = re.search(r"largest score difference: (\S+)", out)
    assert diff and float(diff[1]) < 1e-3, out
    folder = tmp_path / "qwen3-reranker-shape-1l"
    for engine in ("pagoda", "transformers"):
        scores = json.loads((folder / f"scores-{engine}.json").read_text())
        assert len(scores) == 3 and all(0.0 <= s <= 1.0 for s in scores), scores
