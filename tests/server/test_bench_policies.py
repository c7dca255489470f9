"""tools/bench_policies.py: the trace, the time weighting, and a smoke run of the four systems on a tiny model."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from tool_scripts import load_tool

bench = load_tool("bench_policies.py")


def test_trace_is_fixed_by_the_seed_and_mixes_short_and_long_outputs() -> None:
    """Same seed, same trace; prompts start with a shared system prompt; outputs fall in the two ranges."""
    argv = [
        "--num-requests",
        "200",
        "--prompt-len",
        "4-10",
        "--short-output",
        "2-4",
        "--long-output",
        "30-40",
    ]
    argv += ["--system-prompt-len", "8", "--num-system-prompts", "2", "--max-model-len", "64", "--rate", "5"]
    args = bench.build_arg_parser().parse_args(argv)
    trace = bench.make_trace(args, 100)
    assert trace == bench.make_trace(args, 100)
    assert len({t.prompt[:8] for t in trace}) == 2
    assert all(12 <= len(t.prompt) <= 18 and all(8 <= i < 100 for i in t.prompt) for t in trace)
    lengths = {t.output_len for t in trace}
    assert lengths <= set(range(2, 5)) | set(range(30, 41)) and min(lengths) <= 4 and max(lengths) >= 30
    arrivals = [t.arrival for t in trace]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0 and math.isfinite(arrivals[-1])
    args.rate = math.inf
    assert {t.arrival for t in bench.make_trace(args, 100)} == {0.0}


def test_gauges_are_weighted_by_step_duration() -> None:
    """Two steps of 1 s and 3 s: half the KV real then all of it, 2 of 4 seats idle then none."""
    log = bench.StepLog(times=[0.0, 1.0], seats=[4, 4], working=[2, 4], real=[5, 10], reserved=[10, 10])
    kv_real, idle, seats = bench.weighted(log, end=4.0)
    assert kv_real == pytest.approx((0.5 * 1 + 1.0 * 3) / 4)
    assert idle == pytest.approx((0.5 * 1 + 0.0 * 3) / 4)
    assert seats == pytest.approx(4.0)


def test_smoke_on_a_tiny_model(
    tiny_model_path: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """All four systems finish the same work; static batching idles seats, contiguous wastes KV, (d) hits."""
    out = tmp_path / "bench.png"
    argv = ["--model", str(tiny_model_path("llama")), "--num-requests", "8", "--rate", "inf"]
    argv += [
        "--prompt-len",
        "4-10",
        "--short-output",
        "2-4",
        "--long-output",
        "12-20",
        "--long-fraction",
        "0.5",
    ]
    argv += ["--system-prompt-len", "8", "--kv-tokens", "256", "--max-model-len", "64", "--block-size", "4"]
    argv += ["--max-num-seqs", "8", "--dtype", "float32", "--out", str(out)]
    assert bench.main(argv) == 0
    table = capsys.readouterr().out
    for name in (
        "static + contiguous",
        "continuous + contiguous",
        "continuous + paged",
        "paged + prefix cache",
    ):
        assert name in table
    assert out.stat().st_size > 0
    results = {r["name"]: r for r in json.loads(out.with_suffix(".json").read_text())["results"]}
    static, cont, paged, prefix = results.values()
    assert len({r["output_tokens"] for r in results.values()}) == 1
    assert all(len(r["ttft"]) == 8 for r in results.values())
    assert static["idle_rows"] > 0 and cont["idle_rows"] == paged["idle_rows"] == prefix["idle_rows"] == 0
    assert max(static["kv_real"], cont["kv_real"]) < min(paged["kv_real"], prefix["kv_real"])
    assert prefix["prefix_hit_rate"] > 0 == paged["prefix_hit_rate"]
