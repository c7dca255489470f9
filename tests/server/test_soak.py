"""tools/soak.py: its growth arithmetic and table, and a short run against a live server on a tiny model."""

from __future__ import annotations

import pytest
from pagoda.server.testing import free_port
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


# The live soak's requests, RSS samples and what the server may still allocate after the warm-up.
SOAK_REQUESTS, SOAK_EVERY, SOAK_WARMUP = 80, 16, 16
SOAK_KV_GIB = 0.001
# What grows legitimately between the warm-up sample and the last one (64 requests later), each bounded:
# - the KV cache is allocated untouched and its pages join the RSS as blocks are first used; with the prefix cache
#   freed blocks are reused least recently used first, so a varied load touches them all: at most its whole size,
#   SOAK_KV_GIB (1 MiB, ~256 blocks, still room for the longest request: 20 words and 4 tokens, n <= 3);
# - oneDNN's and ideep's primitive caches (one compiled matmul per layer shape and token count, 256 entries each
#   under `pagoda serve`, tens of MB to fill): the test runs the server with them off (0 and 1 entries), so their
#   bounded filling cannot hide a leak (with serve's 256 the same run grew 63 MB after the warm-up);
# - allocator slack: glibc grows its heap in 128 KiB steps and keeps freed memory (engine/host.py), and Python
#   allocates objects in 1 MiB arenas that fragmentation can keep: 2 MiB.
# Measured on a 2-core Sapphire Rapids Xeon: +7.7-8.0 MB over the first 16 requests (the first steps' lazy setup),
# then +0.2-0.8 MB over the next 64; a leak of 60 KB per request (4.8 MB over 64) fails.
SOAK_GROWTH_BOUND_MB = SOAK_KV_GIB * 1024 + 2.0


def test_soak_runs_against_a_live_server(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short soak on a tiny model: every request succeeds, it prints one RSS row per sample, and the RSS grows
    by at most SOAK_GROWTH_BOUND_MB from the warm-up sample to the last (what may still be allocated legitimately)."""
    monkeypatch.setenv(
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0"
    )  # the server inherits them (serve only sets defaults)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "1")
    argv = [
        "--requests",
        str(SOAK_REQUESTS),
        "--every",
        str(SOAK_EVERY),
        "--warmup",
        str(SOAK_WARMUP),
        "--concurrency",
        "4",
        "--port",
        str(free_port()),
    ]
    argv += ["--max-prompt-words", "20", "--max-tokens", "4", "--cancel-fraction", "0.5"]
    argv += ["--serve-arg=--kv-cache-gib", f"--serve-arg={SOAK_KV_GIB}"]
    assert soak.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == list(range(0, SOAK_REQUESTS + 1, SOAK_EVERY))
    rss = {int(row[0]): float(row[1]) for row in rows}
    assert all(mb > 10 for mb in rss.values())  # RSS in MB of a process that loaded torch
    growth = rss[SOAK_REQUESTS] - rss[SOAK_WARMUP]
    assert growth <= SOAK_GROWTH_BOUND_MB, f"RSS grew {growth:.1f} MB after the warm-up: {rss}"
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


def test_surfaces_mode_exercises_every_surface_without_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """--surfaces for a few seconds on a tiny model: stored responses, runtime LoRA, dashboard viewers and keyed
    KV-event subscribers all did operations, none failed, and it printed RSS rows and the growth line."""
    argv = ["--surfaces", "--duration", "4", "--sample-seconds", "1", "--warmup-seconds", "1"]
    argv += ["--port", str(free_port()), "--serve-arg=--kv-cache-gib", "--serve-arg=0.05"]
    assert soak.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    operations = next(line for line in lines if line.startswith("operations: "))
    counts = dict(item.split("=") for item in operations.removeprefix("operations: ").split())
    assert set(counts) == {"responses", "lora", "dashboard", "kv_events"}
    assert all(int(count) > 0 for count in counts.values()), counts
    assert "errors: 0" in lines
    rows = [line.split() for line in lines if line.split() and line.split()[0].replace(".", "").isdigit()]
    assert len(rows) >= 4 and all(float(row[1]) > 10 for row in rows)
    assert any(line.startswith("surfaces: RSS ") and "growth" in line for line in lines)
