"""tools/soak.py: its growth arithmetic and table, and a short run against a live server on a tiny model."""

from __future__ import annotations

import pytest
from api_fake_engine import free_port
from tool_scripts import load_tool

soak = load_tool("soak.py")
MB = 2**20


def test_growth_is_measured_after_the_warmup() -> None:
    """The growth per 1,000 requests spans the first sample at or after the warm-up to the last."""
    samples = [soak.Sample(0, 100 * MB), soak.Sample(500, 300 * MB), soak.Sample(1000, 310 * MB)]
    samples += [soak.Sample(2000, 312 * MB), soak.Sample(3000, 311 * MB)]
    assert soak.growth_per_1000(samples, 1000) == pytest.approx(0.5)
    assert soak.growth_per_1000(samples, 3000) is None
    rows = soak.table(samples).splitlines()
    assert len(rows) == 6 and rows[2].split() == ["500", "300.0", "+200.0"]


def test_soak_runs_against_a_live_server(capsys: pytest.CaptureFixture[str]) -> None:
    """A short soak on a tiny model: every request succeeds, and it prints one RSS row per sample."""
    argv = [
        "--requests",
        "24",
        "--every",
        "8",
        "--warmup",
        "8",
        "--concurrency",
        "4",
        "--port",
        str(free_port()),
    ]
    argv += ["--max-prompt-words", "20", "--max-tokens", "4", "--cancel-fraction", "0.5"]
    argv += ["--serve-arg=--kv-cache-gib", "--serve-arg=0.05"]
    assert soak.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [row[0] for row in rows] == ["0", "8", "16", "24"]
    assert all(float(row[1]) > 10 for row in rows)  # RSS in MB of a process that loaded torch
    assert "MB per 1,000 requests" in lines[-1]


def test_distinct_schemas_report_the_grammar_cache(capsys: pytest.CaptureFixture[str]) -> None:
    """`--distinct-schemas`: every request compiles a schema of its own, and each row after the first gives the
    compiled-grammar cache's size (from /metrics), non-zero once schemas compiled."""
    argv = [
        "--requests",
        "8",
        "--every",
        "4",
        "--warmup",
        "4",
        "--concurrency",
        "2",
        "--port",
        str(free_port()),
    ]
    argv += ["--max-prompt-words", "5", "--max-tokens", "4", "--distinct-schemas"]
    argv += ["--serve-arg=--kv-cache-gib", "--serve-arg=0.05"]
    assert soak.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [row[0] for row in rows] == ["0", "4", "8"]
    assert all(row[-2:] == ["cache", "MB"] and float(row[-3]) > 0 for row in rows[1:])


def test_slow_reader_mode_reports_rss_over_time(capsys: pytest.CaptureFixture[str]) -> None:
    """--slow-reader: two never-reading streamed clients against a live server; one RSS row per sample and the
    peak growth, and the server still stops cleanly."""
    argv = ["--slow-reader", "--concurrency", "2", "--max-tokens", "500", "--duration", "3"]
    argv += ["--sample-seconds", "1", "--port", str(free_port())]
    argv += ["--serve-arg=--kv-cache-gib", "--serve-arg=0.05", "--serve-arg=--stream-stall-timeout=1"]
    assert soak.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split() and line.split()[0].replace(".", "").isdigit()]
    assert len(rows) >= 3 and float(rows[-1][0]) >= 3
    assert all(float(row[1]) > 10 for row in rows)
    assert lines[-1].startswith("slow readers: RSS peak")
