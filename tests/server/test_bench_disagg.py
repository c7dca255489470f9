"""tools/bench_serving.py --disagg: the percentile and summary arithmetic, and a short run of both configurations
against the fake server (table, identity of the probes, PNG, JSON)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from api_fake_engine import FakeEngine, serve_in_thread
from pagoda.server.bench.disagg import CONFIGS, Stream, main, percentile, summarize
from pagoda.server.bench.serving import SERVED_NAME


def test_percentile_is_the_nearest_rank() -> None:
    """p50 and p99 of 1..100 are 50 and 99; one value is every percentile; none is 0."""
    values = [float(v) for v in range(100, 0, -1)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50.0, 99.0, 100.0)
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) == 0.0


def test_summary_counts_gaps_ttft_and_throughput() -> None:
    """Chat gaps are the differences of its chunk times (ms, stamped from the start), TPOT a request's mean gap; a
    failed request counts as failed and adds no tokens; throughput is prompt + output tokens over the window."""
    chat = Stream("chat", 0.0, 10, chunks=[0.5, 0.6, 0.8], output_tokens=3, ok=True)
    doc = Stream("doc", 1.0, 100, chunks=[3.0], output_tokens=1, ok=True)
    lost = Stream("chat", 2.0, 10)
    run = summarize("x", [chat, doc, lost], 0.0, 4.0)
    assert [round(g, 6) for _, g in run["gaps"]] == [100.0, 200.0]
    assert (run["chats"], run["docs"], run["failed"]) == (1, 1, 1)
    assert run["chat_ttft_p50_ms"] == 500.0 and run["doc_ttft_p50_ms"] == 2000.0
    assert round(run["tpot_p99_ms"], 6) == 150.0 and round(run["itl_max_ms"], 6) == 200.0
    assert run["throughput_tok_s"] == (10 + 3 + 100 + 1) / 4.0


def test_a_short_run_of_both_configurations(tmp_path: Path, capsys: object) -> None:
    """Both configurations against the fake server: the table names the CPU and both rows, the probes agree
    (4 of 4), and the PNG and JSON are written."""
    launched: list[str] = []

    @contextmanager
    def launch(args: argparse.Namespace, flags: str) -> Iterator[str]:
        launched.append(flags)
        with serve_in_thread(FakeEngine(max_model_len=256), served_model_name=SERVED_NAME) as server:
            yield server.base_url

    png, out = tmp_path / "itl.png", tmp_path / "run.json"
    argv = ["--disagg", "--duration", "2", "--chat-streams", "2", "--chat-len", "8", "--chat-output", "6",
            "--doc-rate", "3", "--doc-len", "40", "--doc-output", "2", "--max-token-id", "60", "--probe-len", "4",
            "--png", str(png), "--output-json", str(out)]  # fmt: skip
    assert main(argv, launch, "Test CPU") == 0
    assert [f.split(" --replica-cpus")[0] for f in launched] == list(CONFIGS.values())
    printed = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "CPU: Test CPU" in printed and "| colocated" in printed and "| disaggregated" in printed
    assert "identical probe texts: 4/4" in printed
    assert png.stat().st_size > 0
    saved = json.loads(out.read_text())
    assert saved["identical"] == 4 and [r["label"] for r in saved["runs"]] == ["colocated", "disaggregated"]
    assert all(r["chats"] > 0 and r["docs"] > 0 and r["failed"] == 0 for r in saved["runs"])
