"""Smoke test of tools/bench_dashboard.py --quick: the allocator part (with one sliding-window KV cache group) and
the real engine's part print their times and sizes."""

from __future__ import annotations

import re

import pytest
from tool_scripts import load_tool

bench = load_tool("bench_dashboard.py")


def test_quick_run_prints_both_parts(capsys: pytest.CaptureFixture[str]) -> None:
    """Part 1: a full pool's snapshot and encode times and frame size; part 2: the tiny engine's step time and the
    snapshot's share of it."""
    bench.main(["--quick", "--sliding-groups", "1", "--window", "64"])
    out = capsys.readouterr().out
    part1 = re.search(
        r"allocator: 1024 blocks \((\d+) used\), (\d+) running sequences, groups: 1 full \+ 1 x window 64",
        out,
    )
    assert part1 and int(part1[1]) > 0 and int(part1[2]) > 0, out
    times = re.search(r"engine-thread snapshot: ([\d.]+) ms   off-thread encode \+ JSON: ([\d.]+) ms", out)
    assert times and float(times[2]) > 0, out
    frame = re.search(r"frame: ([\d.]+) KiB of JSON", out)
    assert frame and float(frame[1]) > 0, out
    part2 = re.search(r"engine \(tiny llama, float32\): 1024 blocks \((\d+)% used\), 32 running", out)
    assert part2 and int(part2[1]) > 0, out
    step = re.search(r"mean step: ([\d.]+) ms   engine-thread snapshot: ([\d.]+) ms", out)
    assert step and float(step[1]) > 0, out
    assert re.search(r"snapshot / one step: [\d.]+%", out), out
    assert re.search(r"engine-thread share at 4 frames/s: [\d.]+% of each second", out), out
