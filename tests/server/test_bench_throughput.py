"""tools/bench_throughput.py: the workload, the FLOP count, the option parsing, and a smoke run on a tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tool_scripts import load_tool

bench = load_tool("bench_throughput.py")


def test_workload_is_fixed_by_the_seed_and_within_the_ranges() -> None:
    """Same seed, same workload; lengths and token ids stay in their inclusive ranges."""
    a = bench.make_workload(50, (3, 9), (2, 5), 40, seed=7)
    assert a == bench.make_workload(50, (3, 9), (2, 5), 40, seed=7)
    assert a != bench.make_workload(50, (3, 9), (2, 5), 40, seed=8)
    assert {len(p) for p in a.prompts} == set(range(3, 10))
    assert set(a.output_lens) == set(range(2, 6))
    assert all(0 <= t < 40 for p in a.prompts for t in p)
    assert a.prompt_tokens == sum(map(len, a.prompts)) and a.output_tokens == sum(a.output_lens)


@pytest.mark.parametrize("window", [1, 3, 10, 100])
def test_windowed_keys_matches_a_direct_sum(window: int) -> None:
    """Keys read with a sliding window: sum of min(p + 1, window) over the positions."""
    for n in range(0, 30):
        assert bench._windowed_keys(n, window) == sum(min(p + 1, window) for p in range(n))


def test_workload_flops_counts_computed_positions_samples_and_attention() -> None:
    """A 3-token prompt generating 2 tokens computes 4 positions (1+2+3+4 keys) and samples 2 LM heads."""
    workload = bench.Workload(prompts=((1, 2, 3),), output_lens=(2,))
    cost = bench.ModelCost(matmul_params=10, lm_head_flops=1000, attention=((2, 4, None), (2, 4, 2)))
    full = 4 * 2 * 4 * (1 + 2 + 3 + 4)
    windowed = 4 * 2 * 4 * (1 + 2 + 2 + 2)
    assert bench.workload_flops(cost, workload) == 2 * 10 * 4 + 1000 * 2 + full + windowed


def test_parse_compare_accepts_repeats_and_comma_lists() -> None:
    """hf means both peers; none adds nothing; unknown names are rejected."""
    assert bench.parse_compare([]) == ()
    assert bench.parse_compare(["none"]) == ()
    assert bench.parse_compare(["hf"]) == ("hf-batch", "hf-static")
    assert bench.parse_compare(["hf-static", "hf-batch,none"]) == ("hf-batch", "hf-static")
    with pytest.raises(Exception, match="vllm"):
        bench.parse_compare(["vllm"])


def test_cache_sizes_halve_down_to_one_longest_request() -> None:
    """The transformers cache is tried whole first, then halved while it still holds `min_blocks`."""
    assert bench.cache_sizes(300, 7) == [300, 150, 75, 37, 18, 9]
    assert bench.cache_sizes(5, 7) == [7]


def test_table_ratio_is_pagoda_over_each_system() -> None:
    """The ratio column divides Pagoda's output tokens/s by the row's."""
    results = [
        bench.Result("pagoda", 2.0, 4, 40, 100, 4.0, 1.0, None),
        bench.Result("hf-batch", 8.0, 4, 40, 100, 16.0, 1.0, 0.5),
    ]
    table = bench.format_table(results)
    hf_row = next(line for line in table.splitlines() if line.startswith("hf-batch"))
    assert "4.00x" in hf_row and "12.5" in hf_row and "50%" in hf_row


def test_matmul_rate_stops_at_a_call_slower_than_a_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dtype the CPU has no units for is measured by one call per kernel of the first shape, not by rounds."""
    calls: list[tuple[str, tuple[int, ...]]] = []
    clock = iter(float(t) for t in range(100))  # each perf_counter reading is 1 s after the last
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(bench.torch, "mm", lambda a, b, out: calls.append(("mm", (*a.shape, b.shape[1]))))
    monkeypatch.setattr(bench, "linear", lambda a, w: calls.append(("linear", (*a.shape, w.shape[0]))))
    rate = bench.measure_matmul_gflops(seconds=0.5, rounds=5)
    assert calls == [("mm", (256, 640, 2048)), ("linear", (256, 640, 2048))]
    assert rate == pytest.approx(2.0 * 256 * 640 * 2048 / 1e9)


def test_smoke_tiny_llama_against_both_peers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 4-request run prints the table and the roofline, writes the JSON and the plot (no timing asserts)."""
    out = tmp_path / "report.json"
    png = tmp_path / "plot.png"
    argv = ["--tiny", "llama", "--num-requests", "4", "--min-prompt-len", "4", "--max-prompt-len", "12"]
    argv += ["--min-output-len", "2", "--max-output-len", "6", "--compare", "hf", "--matmul-seconds", "0.05"]
    report = bench.main([*argv, "--dtype", "float32", "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    systems = ["pagoda", "hf-batch", "hf-static"]
    assert [row["system"] for row in report["results"]] == systems
    assert json.loads(out.read_text()) == report
    for row in report["results"]:
        assert row["num_requests"] == 4 and row["output_tok_s"] > 0
        assert row["output_tokens"] == report["workload"]["output_tokens"]
        assert any(line.startswith(row["system"]) for line in printed.splitlines())
    # Same float32 weights, greedy: the peers generate Pagoda's tokens.
    assert [row["same_tokens"] for row in report["results"]] == [None, 1.0, 1.0]
    assert report["roofline"]["output_tok_s"] > 0 and "compute roofline (float32)" in printed
    assert [r["dtype"] for r in report["rooflines"]] == ["float32"]
    assert png.stat().st_size > 0


def tiny_argv(num_requests: int, max_output_len: int, dtype: str) -> list[str]:
    """A seconds-long run on a tiny Llama: prompts of 4-8 tokens, outputs of 2 to max_output_len."""
    argv = [
        "--tiny",
        "llama",
        "--num-requests",
        str(num_requests),
        "--min-prompt-len",
        "4",
        "--max-prompt-len",
    ]
    argv += ["8", "--min-output-len", "2", "--max-output-len", str(max_output_len), "--dtype", dtype]
    return [*argv, "--matmul-seconds", "0.02"]


def test_bfloat16_run_prints_both_rooflines(capsys: pytest.CaptureFixture[str]) -> None:
    """In bfloat16 the report names the dtype and adds the bfloat16 roofline after the float32 one."""
    report = bench.main(tiny_argv(2, 4, "bfloat16"))
    printed = capsys.readouterr().out
    assert report["dtype"] == "bfloat16"
    assert [r["dtype"] for r in report["rooflines"]] == ["float32", "bfloat16"]
    assert "compute roofline (bfloat16)" in printed and "Pagoda (bfloat16)" in printed


def test_sampling_sweep_runs_four_settings_on_one_workload(capsys: pytest.CaptureFixture[str]) -> None:
    """--sampling-sweep runs greedy, the three sampled settings and greedy again, and prints each ratio to the
    faster greedy run."""
    argv = tiny_argv(3, 4, "float32")
    report = bench.main([*argv, "--sampling-sweep"])
    printed = capsys.readouterr().out
    names = [
        "greedy",
        "temperature 1.0",
        "temperature 0.8, top_p 0.95",
        "temperature 1.0, top_k 50",
        "greedy (again)",
    ]
    assert [row["name"] for row in report["sweep"]] == names
    assert [(row["temperature"], row["top_p"], row["top_k"]) for row in report["sweep"]] == [
        (0.0, 1.0, None),
        (1.0, 1.0, None),
        (0.8, 0.95, None),
        (1.0, 1.0, 50),
        (0.0, 1.0, None),
    ]
    assert max(report["sweep"][0]["ratio_to_greedy"], report["sweep"][4]["ratio_to_greedy"]) == 1.0
    assert all(row["output_tok_s"] > 0 for row in report["sweep"])
    lines = printed.splitlines()
    for name in names:
        assert any(line.startswith(name) and re.search(r" \d+\.\d\dx ", line) for line in lines), name
    assert any(line.startswith("greedy") and " 1.00x " in line for line in lines)


def test_sampling_flags_set_pagodas_requests(capsys: pytest.CaptureFixture[str]) -> None:
    """--temperature, --top-p, --top-k and --min-p reach the run; they refuse the greedy peers and the sweep."""
    argv = tiny_argv(2, 3, "float32")
    sampled = ["--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05"]
    report = bench.main([*argv, *sampled])
    assert report["sampling"] == {
        "name": "command line",
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
    }
    assert report["sweep"] is None and report["results"][0]["output_tokens"] > 0
    capsys.readouterr()
    for bad in (["--compare", "hf"], ["--sampling-sweep"], ["--top-p", "1.5"]):
        with pytest.raises(SystemExit):
            bench.parse_args([*sampled[:2], *bad])


@pytest.mark.timeout(300)
def test_tensor_parallel_run_reports_its_collectives(capsys: pytest.CaptureFixture[str]) -> None:
    """--tensor-parallel-size 2 runs the workload again on two ranks: the same greedy tokens, and rank 0's time in
    collectives per step is reported."""
    report = bench.main([*tiny_argv(3, 4, "float32"), "--tensor-parallel-size", "2"])
    printed = capsys.readouterr().out
    tp = report["tensor_parallel"]
    assert tp["size"] == 2 and tp["steps"] > 0 and tp["collective_calls"] > 0 and tp["collective_s"] > 0
    assert [r["system"] for r in report["results"]] == ["pagoda", "pagoda tp=2"]
    assert report["results"][1]["same_tokens"] == 1.0
    assert re.search(r"rank 0 spent \d+\.\d\d ms per step in collectives", printed)
    with pytest.raises(SystemExit):
        bench.parse_args(["--tensor-parallel-size", "2", "--temperature", "1.0"])
