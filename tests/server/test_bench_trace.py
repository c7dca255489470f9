"""tools/bench_serving.py --trace: the seeded phased trace, goodput per phase, a run against the fake server
(its /metrics gives the step shape), the table, the PNG, and tools/bench_adaptive.py's target ratios."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from api_fake_engine import FakeEngine, serve_in_thread
from pagoda.server.bench import serving as bench_serving
from pagoda.server.bench.trace import (
    PHASES,
    TraceRequest,
    make_trace,
    metric_value,
    phase_goodput,
    plot_trace,
    run_trace,
    trace_table,
)

WORDS = ["alpha", "beta", "gamma"]


def test_the_trace_is_seeded_and_phased() -> None:
    """Same seed, same trace; arrivals sorted and inside their phase; lengths in the documented ranges."""
    trace = make_trace(7, WORDS, 30.0)
    assert trace == make_trace(7, WORDS, 30.0) != make_trace(8, WORDS, 30.0)
    assert [r.at for r in trace] == sorted(r.at for r in trace)
    for request in trace:
        index = PHASES.index(request.phase)
        assert 30.0 * index <= request.at < 30.0 * (index + 1)
        words = len(request.prompt.split())
        assert (16 <= words <= 64 and 16 <= request.max_tokens <= 64) or (
            1500 <= words <= 3000 and 8 <= request.max_tokens <= 32
        )
    chatty = [r for r in trace if r.phase == "chatty"]
    documents = [r for r in trace if r.phase == "documents"]
    assert all(len(r.prompt.split()) <= 64 for r in chatty)
    assert all(len(r.prompt.split()) >= 1500 for r in documents)
    mixed = {len(r.prompt.split()) >= 1500 for r in trace if r.phase == "mixed"}
    assert mixed == {True, False}  # both kinds
    assert 30 < len(chatty) < 90  # 2 req/s for 30 s


def test_trace_flags_set_the_objectives_and_refuse_bad_values() -> None:
    """--trace defaults the objectives (ttft:2500 tpot:150) and draws the trace; bad lengths exit 2."""
    args = bench_serving.parse_args(["--model", "m", "--trace", "--phase-seconds", "5"])
    assert args.goodput == [("ttft", 2500.0), ("tpot", 150.0)]
    assert args.trace_requests and args.trace_requests[-1].at < 15.0
    with pytest.raises(SystemExit) as info:
        bench_serving.parse_args(["--model", "m", "--trace", "--phase-seconds", "0"])
    assert info.value.code == 2


def test_goodput_per_phase_is_met_requests_over_the_phase() -> None:
    """Each phase's met requests over its length; the whole trace's over the run."""
    records = [{"phase": "chatty"}, {"phase": "chatty"}, {"phase": "documents"}, {"phase": "mixed"}]
    result = phase_goodput(records, [True, False, True, True], phase_seconds=2.0, duration=10.0)
    assert result == {"chatty": 0.5, "documents": 0.5, "mixed": 0.5, "all": 0.3}
    text = 'x_total 1\npagoda:scheduler_token_budget{model_name="m"} 96.0\n'
    assert metric_value(text, "scheduler_token_budget") == 96.0 and metric_value(text, "nope") is None


def test_a_trace_run_against_the_fake_server(tmp_path: Path) -> None:
    """Short requests at their arrival times: every one completes, goodput counts them, the step shape is
    sampled from /metrics; the table and the PNG come out."""
    args = bench_serving.parse_args(["--model", "test-model", "--trace", "--phase-seconds", "0.4"])
    trace = [TraceRequest(0.1 * i, PHASES[min(i // 4, 2)], "hello there", 3) for i in range(12)]
    with serve_in_thread(FakeEngine(max_model_len=64)) as server:
        target = bench_serving.Target(server.base_url, "test-model", "fake")
        run = asyncio.run(run_trace(args, target, trace, bench_serving.send, bench_serving.met_slos))
    assert run["completed"] == 12 and run["failed"] == 0
    assert run["goodput"]["chatty"] == pytest.approx(4 / 0.4)
    assert run["attainment"] == 1.0 and run["shape"] and run["shape"][0][1:] == [64.0, 32.0]
    assert "fake" in trace_table([run]) and "whole trace" in trace_table([run])
    assert plot_trace([run], 0.4, tmp_path / "trace.png") and (tmp_path / "trace.png").stat().st_size > 1000


def test_the_runner_reports_the_issues_ratios() -> None:
    """adaptive against the best fixed profile per phase (>= 0.95x) and over the trace (>= 1.1x; >= 1.2x the
    default)."""
    path = Path(__file__).resolve().parents[2] / "tools" / "bench_adaptive.py"
    spec = importlib.util.spec_from_file_location("bench_adaptive", path)
    assert spec is not None and spec.loader is not None
    tool: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    good = {p: 1.0 for p in (*PHASES, "all")}
    runs = [
        {"target": "default", "goodput": {**good, "all": 0.5}},
        {"target": "latency", "goodput": {**good, "chatty": 2.0}},
        {"target": "adaptive", "goodput": {**good, "chatty": 1.9, "all": 1.2}},
    ]
    lines = tool.ratios(runs)
    assert "chatty: adaptive / best fixed (latency) = 0.95x (target >= 0.95x)" in lines
    assert "all: adaptive / best fixed (latency) = 1.20x (target >= 1.1x)" in lines
    assert "all: adaptive / default = 2.40x (target >= 1.2x)" in lines
    assert "Xeon" in tool.cpu_name() or tool.cpu_name()


def test_the_client_drops_idle_connections_before_the_server_closes_them() -> None:
    """A pooled connection is dropped before the server's keep-alive timeout: at equal timeouts a request sent as
    the server closes its idle connection fails (a ReadError after the documents phase's quiet seconds)."""
    from pagoda.server.api.http_protocol import HTTPConfig
    from pagoda.server.config import HTTPLimits

    server = HTTPConfig(object(), HTTPLimits())
    expiry = bench_serving.client_limits().keepalive_expiry
    assert expiry is not None and expiry < server.timeout_keep_alive
