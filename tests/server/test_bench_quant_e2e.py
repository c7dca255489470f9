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


def test_perplexity_beside_llama_perplexity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--perplexity-text scores each mode by llama-perplexity's protocol; --llama-perplexity runs the peer (a
    stand-in script printing llama.cpp's final line) on the same file, text and chunk size, and the ratio is shown."""
    path, _ = write_tiny_gguf("llama", tmp_path / "tiny.gguf", lambda name: "Q8_0")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 37}" for i in range(400)))
    peer = tmp_path / "llama-perplexity"
    peer.write_text(
        '#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\necho "Final estimate: PPL = 12.5000 +/- 0.1" >&2\n'
    )
    peer.chmod(0o755)
    out = tmp_path / "out.json"
    args = [
        "--model",
        str(path),
        "--batch",
        "1",
        "--output-len",
        "2",
        "--single-output",
        "2",
        "--prompt-len",
        "4",
    ]
    args += ["--single-requests", "1", "--dtype", "float32", "--cache-dir", str(tmp_path / "cache")]
    args += ["--perplexity-text", str(text), "--perplexity-ctx", "16", "--llama-perplexity", str(peer)]
    assert load_tool("bench_quant_e2e.py").main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["llama_perplexity"] == 12.5
    assert all(r["perplexity"] > 1.0 for r in report["results"])
    assert f"-m {path} -f {text} -c 16" in (tmp_path / "args").read_text()
    assert "x llama-perplexity" in capsys.readouterr().out
