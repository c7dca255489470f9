"""tools/bench_quant_e2e.py: a smoke run on a tiny quantized GGUF (both modes, the resident bytes, the profile)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pagoda.server.testing.tiny_gguf import write_tiny_gguf
from tool_scripts import load_tool


def test_smoke_run_reports_both_modes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both modes run; the quantized weights take about the file's bytes, the dequantized ones several times it."""
    path, _ = write_tiny_gguf("llama", tmp_path / "tiny.gguf", lambda name: "Q8_0")
    out = tmp_path / "out.json"
    args = [
        "--model",
        str(path),
        "--batch",
        "2",
        "--output-len",
        "3",
        "--single-output",
        "3",
        "--prompt-len",
        "6",
    ]
    args += ["--single-requests", "1", "--profile", "--profile-steps", "2", "--dtype", "float32"]
    assert (
        load_tool("bench_quant_e2e.py").main(
            [*args, "--cache-dir", str(tmp_path / "cache"), "--json", str(out)]
        )
        == 0
    )
    report = json.loads(out.read_text())
    gguf, none = report["results"]
    assert (gguf["mode"], none["mode"]) == ("gguf", "none")
    assert gguf["resident_bytes"] <= 1.15 * report["file_bytes"] < none["resident_bytes"]
    assert all(r["single_tok_s"] > 0 and r["batch_tok_s"] > 0 and r["profile"] for r in (gguf, none))
    assert "| gguf |" in capsys.readouterr().out
