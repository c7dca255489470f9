"""tools/bench_serving.py's peers: --peer starts a server by command beside --serve's (same prompts, alternating
runs, a ratio table), --peer-url adds a running one, --single-stream sends one request at a time."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import pytest
from pagoda.server.bench import serving as bench_serving

ROOT = Path(__file__).resolve().parents[2]


def test_peer_options_are_checked() -> None:
    """A peer needs LABEL=...; peers run beside --serve; --single-stream means max concurrency 1 at rate inf."""
    args = bench_serving.parse_args(["--serve", "a=", "--single-stream"])
    assert args.max_concurrency == 1 and args.request_rate == [float("inf")]
    for argv in (
        ["--serve", "a=", "--peer", "no-label"],
        ["--serve", "a=", "--peer-url", "http://x:1"],
        ["--model", "m", "--peer", "b=cmd"],
        ["--serve", "a=", "--single-stream", "--request-rate", "2"],
        ["--serve", "a=", "--single-stream", "--max-concurrency", "4"],
    ):
        with pytest.raises(SystemExit):
            bench_serving.parse_args(argv)


def test_a_peer_that_exits_is_reported() -> None:
    """A peer command that exits before serving is a RuntimeError naming its status and the command."""
    command = f"{shlex.quote(sys.executable)} -c 'raise SystemExit(3)'"
    with (
        pytest.raises(RuntimeError, match="peer exited with status 3"),
        bench_serving.peer_launched(command, 60),
    ):
        pass


@pytest.mark.parametrize("isolate", [False, True], ids=["alternating", "isolated"])
def test_serve_and_a_started_peer_run_the_same_prompts_one_at_a_time(
    tiny_model_path: Callable[[str], Path], tmp_path: Path, isolate: bool
) -> None:
    """Pagoda by --serve and a second server by --peer (here Pagoda again, under another name): both complete
    every request with one in flight, and the ratio table compares them (all up and alternating, or
    --isolate: one up at a time)."""
    model = str(tiny_model_path("llama"))
    small = "--dtype float32 --kv-cache-gib 0.01 --block-size 4 --max-model-len 64"
    peer = f"{shlex.quote(sys.executable)} -m pagoda.server.cli serve {model} --port {{port}} {small} --served-model-name peer-model"
    command = [sys.executable, str(ROOT / "tools" / "bench_serving.py"), "--serve-model", model]
    command += [
        "--settle",
        "0",
        "--serve",
        f"pagoda={small}",
        "--peer",
        f"peer={peer}",
        "--single-stream",
        "--num-prompts",
        "3",
    ]
    command += ["--input-len", "6", "--output-len", "4", "--ignore-eos", "--output-dir", str(tmp_path)]
    command += ["--isolate"] if isolate else []
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "MPLBACKEND": "Agg"}
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "bench_serving.json").read_text())
    runs = {run["target"]: run for run in report["runs"]}
    assert set(runs) == {"pagoda", "peer"}
    assert all(run["completed"] == 3 and run["failed"] == 0 for run in runs.values())
    assert report["config"]["max_concurrency"] == 1
    assert "Ratio to pagoda" in result.stdout


def test_isolate_starts_each_server_after_the_last_one_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """--isolate: each server is started, run at every rate and stopped before the next starts; without it all
    are up first and the runs alternate between them at each rate."""
    events: list[str] = []

    @contextmanager
    def group(args: Any, spec: str, *launcher: Any) -> Iterator[list[Any]]:
        label = spec.split("=", 1)[0]
        events.append(f"up {label}")
        yield [bench_serving.Target(f"http://{label}", "m", label)]
        events.append(f"down {label}")

    async def fake_run(args: Any, target: Any, requests: Any, rate: float) -> dict[str, Any]:
        events.append(f"run {target.label} {rate:g}")
        return {"target": target.label}

    monkeypatch.setattr(bench_serving, "_served", group)
    monkeypatch.setattr(bench_serving, "_peer", group)
    monkeypatch.setattr(bench_serving, "run_rate", fake_run)
    argv = [
        "--serve",
        "a=",
        "--peer",
        "b=cmd",
        "--request-rate",
        "1",
        "4",
        "--num-prompts",
        "2",
        "--settle",
        "0",
    ]
    launch = cast(Any, "the launcher --serve's groups get")  # the fake groups start nothing
    bench_serving.run_all(bench_serving.parse_args([*argv, "--isolate"]), launch)
    assert events == ["up a", "run a 1", "run a 4", "down a", "up b", "run b 1", "run b 4", "down b"]
    events.clear()
    bench_serving.run_all(bench_serving.parse_args(argv), launch)
    assert events == ["up a", "up b", "run a 1", "run b 1", "run a 4", "run b 4", "down b", "down a"]
