"""Start-up benchmark: how long `pagoda serve` takes from the process's start to /health 200, phase by phase.

Starts `pagoda serve` (the default model, or `--model PATH`) `--warmup` times unmeasured (page cache, compiled
kernels, converted model all warm), then `--runs` times measured. Each run polls /health every 10 ms from the
moment the process is spawned, then sends a one-token completion as soon as /health says 200 and times its answer.
The phases come from the server's own `startup <phase>: ...` log lines (pagoda.server.startup); they may overlap
(the tokenizer loads on a thread of its own beside the weights). Prints one table of medians:

    python tools/bench_startup.py                          # the default model, 1 warm-up + 3 runs
    python tools/bench_startup.py --model tiny             # the tiny random Llama of the tests
    python tools/bench_startup.py --model /path/to/model.gguf --runs 5 --serve-arg=--dtype=bfloat16

The machine's load average is printed with the table: on a shared machine the numbers swing with it.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from pagoda.server.testing import LiveServer, make_tiny_model

# `startup <phase>: <seconds> s (done <seconds> s after the process started)` (pagoda.server.startup.PHASE_FORMAT).
_PHASE = re.compile(r"startup (?P<name>[^:]+): (?P<seconds>[0-9.]+) s \(done (?P<done>[0-9.]+) s after")
POLL_S = 0.01


@dataclass(slots=True)
class Run:
    """One measured start."""

    health_s: float  # from the spawn to the first /health 200
    completion_s: float  # a one-token completion sent right after /health 200
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (seconds, done at)


def parse_phases(log: str) -> dict[str, tuple[float, float]]:
    """The `startup` lines of a server log: phase -> (seconds, seconds after the process started)."""
    phases: dict[str, tuple[float, float]] = {}
    for match in _PHASE.finditer(log):
        phases[match["name"]] = (float(match["seconds"]), float(match["done"]))
    return phases


def measure(model: str | None, serve_args: list[str]) -> Run:
    """Start the server once; time /health and a one-token completion; its phase lines."""
    spawned = time.monotonic()
    server = LiveServer(model, [*serve_args, "--log-level", "info"], ready_timeout=600, poll_interval=POLL_S)
    try:
        health = time.monotonic() - spawned  # the constructor returns at the first /health 200
        body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
        start = time.monotonic()
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        completion = time.monotonic() - start
        response.raise_for_status()
        log = server.log_tail(10_000)
    finally:
        server.stop()
    return Run(health, completion, parse_phases(log))


def table(runs: list[Run]) -> str:
    """The median of every phase over the runs, in the order the phases end, then the totals."""
    names = sorted({name for run in runs for name in run.phases}, key=lambda n: _median(runs, n, 1))
    lines = ["| phase | seconds (median) | done at (s after the process started) |", "| --- | --- | --- |"]
    for name in names:
        lines.append(f"| {name} | {_median(runs, name, 0):.2f} | {_median(runs, name, 1):.2f} |")
    health = statistics.median(run.health_s for run in runs)
    completion = statistics.median(run.completion_s for run in runs)
    lines.append(f"| **/health 200** (spawn to first 200) | | **{health:.2f}** |")
    lines.append(f"| one-token completion right after | {completion:.2f} | |")
    return "\n".join(lines)


def _median(runs: list[Run], name: str, index: int) -> float:
    values = [run.phases[name][index] for run in runs if name in run.phases]
    return statistics.median(values) if values else float("nan")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or the machine type."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", help="a model folder or .gguf, `tiny` for the tests' tiny Llama (default: the server's)"
    )
    parser.add_argument("--runs", type=int, default=3, help="measured starts (the median is printed)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured starts first (caches warm)")
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="a flag for `pagoda serve` (repeat it)"
    )
    args = parser.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        parser.error("--runs must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the phase table."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-startup-model-") as scratch:
        model = args.model
        if model == "tiny":
            model = str(make_tiny_model("llama", Path(scratch) / "tiny"))
        for index in range(args.warmup):
            measure(model, args.serve_arg)
            print(f"warm-up start {index + 1} done", file=sys.stderr)
        runs = []
        for index in range(args.runs):
            run = measure(model, args.serve_arg)
            runs.append(run)
            print(f"run {index + 1}: /health 200 after {run.health_s:.2f} s", file=sys.stderr)
    load = os.getloadavg()
    print(
        f"model: {args.model or 'the default'}; {cpu_name()}, {os.cpu_count()} CPUs; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print(f"/health 200 per run: {', '.join(f'{run.health_s:.2f}' for run in runs)} s")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
