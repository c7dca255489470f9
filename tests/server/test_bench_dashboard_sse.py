"""Smoke test of tools/bench_dashboard_sse.py: one round without and with a viewer of /dashboard/events against a
live tiny server, then the slow-viewer phases, as short as they go."""

from __future__ import annotations

import re

import pytest
from tool_scripts import load_tool

bench = load_tool("bench_dashboard_sse.py")


def test_one_round_and_short_slow_phases(capsys: pytest.CaptureFixture[str]) -> None:
    """A frame's size at rest, tokens/s and ITL without and with the viewer, the frames it read, and the server's
    RSS after each slow-viewer phase."""
    args = ["--viewers", "1", "--rounds", "1", "--requests", "2", "--max-tokens", "4", "--concurrency", "2"]
    bench.main([*args, "--slow", "1", "--slow-seconds", "0.2"])
    out = capsys.readouterr().out
    rest = re.search(r"a frame: ([\d.]+) KiB of JSON at rest, (\d+) blocks", out)
    assert rest and float(rest[1]) > 0 and int(rest[2]) > 0, out
    for name in ("no viewer", "1 viewers"):
        line = re.search(
            rf"{name}: output tok/s \[([\d.]+)\] \(median [\d.]+\), mean ITL ms \[([\d.]+)\]", out
        )
        assert line and float(line[1]) > 0 and float(line[2]) > 0, out
    frames = re.search(
        r"tok/s with / without viewers: [\d.]+; frames the viewers read per round: \[(\d+)\]", out
    )
    assert frames and int(frames[1]) >= 1, out
    rss = re.search(
        r"server RSS: (\d+) MiB at start, (\d+) MiB after .* (\d+) MiB after .* (\d+) MiB after", out
    )
    assert rss and all(int(rss[i]) > 0 for i in range(1, 5)), out
