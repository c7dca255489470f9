"""tools/bench_spec.py: a smoke run on the tiny model (the real figures need the default model)."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from tool_scripts import load_tool

bench = load_tool("bench_spec.py")


def test_smoke_run_reports_every_method_workload_and_concurrency(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    argv = ["--tiny", "--max-tokens", "8", "--max-prompt-tokens", "40", "--concurrency", "1", "2"]
    results = bench.main([*argv, "--num-speculative-tokens", "2", "--json", str(out)])
    cells = {(r.method, r.workload, r.concurrency) for r in results}
    assert cells == {
        (m, w, c)
        for m in ("none", "ngram", "suffix", "auto")
        for w in ("repeat", "code_edit", "random")
        for c in (1, 2)
    }
    assert all(r.output_tokens == 8 * r.concurrency and r.tok_per_s > 0 for r in results)
    assert all(r.acceptance_length is None for r in results if r.method == "none")
    assert len(json.loads(out.read_text())) == len(results)


def test_draft_model_method(tmp_path: Path) -> None:
    """--methods none draft_model with --tiny: a one-layer tiny draft (whose step costs what the tiny target's
    does, so the policy may draft nothing: no acceptance length is asserted)."""
    argv = ["--tiny", "--max-tokens", "6", "--max-prompt-tokens", "24", "--concurrency", "1"]
    results = bench.main(
        [*argv, "--methods", "none", "draft_model", "--num-speculative-tokens", "2", "--workloads", "repeat"]
    )
    assert {(r.method, r.workload, r.concurrency) for r in results} == {
        ("none", "repeat", 1),
        ("draft_model", "repeat", 1),
    }
    assert all(r.output_tokens == 6 and r.tok_per_s > 0 for r in results)


def test_each_engine_is_warmed_up_before_its_first_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every method's engine generates its untimed warm-up (two tokens) before the first timed cell, and the
    warm-up's tokens are not counted in any cell."""
    events: list[str] = []
    warm_up, run = bench.warm_up, bench.run

    def record_warm_up(llm: object, seed: int) -> None:
        events.append("warm")
        warm_up(llm, seed)

    def record_run(*args: object) -> object:
        events.append("run")
        return run(*args)

    monkeypatch.setattr(bench, "warm_up", record_warm_up)
    monkeypatch.setattr(bench, "run", record_run)
    argv = ["--tiny", "--max-tokens", "4", "--max-prompt-tokens", "24", "--concurrency", "1"]
    results = bench.main([*argv, "--methods", "none", "ngram", "--workloads", "repeat"])
    assert events == ["warm", "run", "warm", "run"]
    assert all(r.output_tokens == 4 for r in results)


def test_a_peer_server_runs_the_same_prompts(tiny_model_path: Callable[[str], Path]) -> None:
    """--peer LABEL=COMMAND starts a server (here `pagoda serve` on the same tiny model, standing in for
    llama-server) and sends it every workload's prompt at every concurrency, as token ids; its rows sit beside
    the engine's with their tok/s ratio to the first method."""
    model = str(tiny_model_path("llama"))
    peer = (
        f"{shlex.quote(sys.executable)} -m pagoda.server.cli serve {model} --port {{port}} --dtype float32"
        " --kv-cache-gib 0.02 --max-model-len 128"
    )
    argv = ["--model", model, "--methods", "none", "--max-tokens", "5", "--max-prompt-tokens", "30"]
    results = bench.main([*argv, "--concurrency", "1", "3", "--peer", f"peer={peer}"])
    peer_rows = [r for r in results if r.method == "peer"]
    assert {(r.workload, r.concurrency) for r in peer_rows} == {
        (w, c) for w in ("repeat", "code_edit", "random") for c in (1, 3)
    }
    assert all(r.output_tokens == 5 * r.concurrency and r.tok_per_s > 0 for r in peer_rows)
    assert all(r.acceptance_length is None and r.acceptance_rate is None for r in peer_rows)
    assert "vs base" in bench.table(results) and "peer" in bench.table(results)


def test_rounds_run_each_method_in_a_fresh_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--rounds 2: each method runs once a round in a child process, the second round in the reverse order; the
    summary gives each cell's median and per-round ratios. --rounds below 1, or with --peer, exits 2 naming it."""
    argv = ["--tiny", "--max-tokens", "6", "--max-prompt-tokens", "24", "--concurrency", "1", "2"]
    argv += ["--methods", "none", "ngram", "--workloads", "repeat", "--num-speculative-tokens", "2"]
    results = bench.main([*argv, "--rounds", "2", "--json", str(tmp_path / "rounds.json")])
    assert [(r.round, r.method, r.concurrency) for r in results] == [
        (1, "none", 1),
        (1, "none", 2),
        (1, "ngram", 1),
        (1, "ngram", 2),
        (2, "ngram", 1),
        (2, "ngram", 2),
        (2, "none", 1),
        (2, "none", 2),
    ]
    assert all(r.output_tokens == 6 * r.concurrency and r.tok_per_s > 0 for r in results)
    summary = capsys.readouterr().out.split("per round")[1].splitlines()[1:]
    assert [line.split()[:4] for line in summary] == [
        ["none", "repeat", "1", "2"],
        ["none", "repeat", "2", "2"],
        ["ngram", "repeat", "1", "2"],
        ["ngram", "repeat", "2", "2"],
    ]
    assert summary[0].split()[5:] == ["1.00x", "1.00-1.00x"]
    assert len(json.loads((tmp_path / "rounds.json").read_text())) == 8
    for bad, named in [(["--rounds", "0"], "--rounds"), (["--rounds", "2", "--peer", "x=y"], "--peer")]:
        with pytest.raises(SystemExit) as exit_info:
            bench.main([*argv, *bad])
        assert exit_info.value.code == 2 and named in capsys.readouterr().err


copy_bound = load_tool("spec_copy_bound.py")


def test_copy_bound_scores_the_copied_text() -> None:
    """tools/spec_copy_bound.py on the tiny model: both copy workloads, probabilities in [0, 1] whose products are
    the copy chances, and tokens per step between 1 and k + 1."""
    bounds = copy_bound.main(["--tiny", "--max-prompt-tokens", "60", "--copy-tokens", "20"])
    assert [b.workload for b in bounds] == ["repeat", "code_edit"]
    for b in bounds:
        assert b.num_tokens > 5 and 0.0 <= b.mean_p <= 1.0 and 0.0 <= b.argmax_fraction <= 1.0
        assert abs(b.p_copy_first[1] - b.first_p[0]) < 1e-3 and b.p_copy_first[5] <= b.p_copy_first[1]
        assert all(1.0 <= t <= k + 1 for k, t in b.tokens_per_step.items())


def test_expected_tokens_per_step() -> None:
    """1 + p1 + p1 p2 + ..., averaged over the starting positions."""
    assert copy_bound.expected_tokens_per_step([1.0] * 10, 4) == 5.0
    assert copy_bound.expected_tokens_per_step([0.0] * 10, 4) == 1.0
    assert abs(copy_bound.expected_tokens_per_step([0.5] * 10, 2) - 1.75) < 1e-12
