"""tools/bench_serving.py without a server: datasets, the statistics it reports, its table."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from pagoda.server.bench import serving as bench_serving


def test_random_lengths_stay_in_the_range() -> None:
    """random: prompts of about --input-len words and max_tokens within len * (1 +- ratio)."""
    args = bench_serving.parse_args(
        [
            "--model",
            "m",
            "--num-prompts",
            "50",
            "--input-len",
            "20",
            "--output-len",
            "10",
            "--range-ratio",
            "0.5",
        ]
    )
    requests = bench_serving.make_requests(args, random.Random(0))
    assert len(requests) == 50
    assert all(10 <= len(r.prompt.split()) <= 30 and 5 <= r.max_tokens <= 15 for r in requests)
    assert len({r.max_tokens for r in requests}) > 1


def test_each_rate_gets_its_own_prompts() -> None:
    """Rates draw different prompts (no prefix-cache hits across rates), deterministically from --seed."""
    argv = [
        "--model",
        "m",
        "--num-prompts",
        "8",
        "--input-len",
        "16",
        "--request-rate",
        "1",
        "inf",
        "--seed",
        "3",
    ]
    first, second = bench_serving.requests_per_rate(bench_serving.parse_args(argv))
    assert len(first) == len(second) == 8
    assert {r.prompt for r in first}.isdisjoint(r.prompt for r in second)
    assert bench_serving.requests_per_rate(bench_serving.parse_args(argv)) == [first, second]


def test_sharegpt_like_lengths_have_a_long_tail_but_a_cap() -> None:
    """sharegpt-like: log-normal lengths around the medians, capped at four times them."""
    args = bench_serving.parse_args(
        ["--model", "m", "--num-prompts", "400", "--dataset", "sharegpt-like", "--output-len", "50"]
    )
    lengths = sorted(r.max_tokens for r in bench_serving.make_requests(args, random.Random(1)))
    assert lengths[0] >= 1 and lengths[-1] <= 200
    assert 35 <= lengths[len(lengths) // 2] <= 65  # the median stays near --output-len
    assert lengths[-1] > 2 * lengths[len(lengths) // 2]  # and there is a tail


def test_sharegpt_file(tmp_path: Path) -> None:
    """sharegpt: the first human turn is the prompt; the reply's word count (capped) is max_tokens."""
    data = [
        {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "a b c"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"conversations": [{"from": "human", "value": "long"}, {"from": "gpt", "value": "w " * 500}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    args = bench_serving.parse_args(
        ["--model", "m", "--dataset", "sharegpt", "--dataset-path", str(path), "--output-len", "64"]
    )
    requests = sorted(bench_serving.make_requests(args, random.Random(0)), key=lambda r: r.prompt)
    assert [(r.prompt, r.max_tokens) for r in requests] == [("hi there", 3), ("long", 64)]


def test_summary_statistics_and_table() -> None:
    """Throughputs, TPOT and the p99 follow vLLM's definitions; the table has one column per rate."""
    results = [
        bench_serving.RequestResult(
            success=True,
            prompt_tokens=10,
            output_tokens=5,
            ttft=0.1 * (i + 1),
            latency=0.5 + 0.1 * i,
            itl=[0.1] * 4,
        )
        for i in range(4)
    ]
    results.append(bench_serving.RequestResult(error="HTTP 429"))
    summary = bench_serving.summarize(results, duration=2.0, rate=float("inf"))
    assert (summary["completed"], summary["failed"], summary["errors"]) == (4, 1, ["HTTP 429"])
    assert summary["output_throughput"] == 10.0 and summary["request_throughput"] == 2.0
    assert summary["total_token_throughput"] == 30.0
    assert summary["mean_ttft_ms"] == pytest.approx(250.0)
    assert summary["p99_ttft_ms"] == pytest.approx(400.0)
    assert summary["mean_tpot_ms"] == pytest.approx(100.0)  # (latency - ttft) / (5 - 1) = 0.1 s for each
    assert summary["median_itl_ms"] == pytest.approx(100.0)
    text = bench_serving.table([summary, {**summary, "request_rate": 2.0}])
    assert text.splitlines()[0].split("|")[1:] == [" rate inf ", " rate 2.0"]
    assert "Output token throughput (tok/s) | 10.00" in text


def test_requests_send_no_temperature_unless_asked() -> None:
    """By default the body has no temperature (the server's default applies); --temperature sends it."""
    target = bench_serving.Target("http://a:1", "m", "a:1")
    request = bench_serving.BenchRequest("hello there", 16)
    body = bench_serving.request_body(bench_serving.parse_args(["--model", "m"]), target, request)
    assert "temperature" not in body
    assert (body["model"], body["prompt"], body["max_tokens"], body["stream"]) == (
        "m",
        "hello there",
        16,
        True,
    )
    for value in ("0", "0.8"):
        args = bench_serving.parse_args(["--model", "m", "--temperature", value, "--ignore-eos"])
        body = bench_serving.request_body(args, target, request)
        assert body["temperature"] == float(value) and body["ignore_eos"] is True


def test_bad_options_are_refused() -> None:
    """A range ratio outside [0, 1), a non-positive rate, a temperature outside [0, 2] or a negative --settle is
    a usage error."""
    for argv in (
        ["--range-ratio", "1.5"],
        ["--request-rate", "0"],
        ["--temperature", "-1"],
        ["--settle", "-1"],
    ):
        with pytest.raises(SystemExit):
            bench_serving.parse_args(["--model", "m", *argv])


def test_several_servers_share_one_model_name_or_get_one_each() -> None:
    """Several --base-url values are benchmarked side by side, labelled by host:port."""
    args = bench_serving.parse_args(["--base-url", "http://a:1/v1", "http://b:2/", "--model", "m"])
    assert [(t.base_url, t.model, t.label) for t in bench_serving.targets(args)] == [
        ("http://a:1", "m", "a:1"),
        ("http://b:2", "m", "b:2"),
    ]
    args = bench_serving.parse_args(["--base-url", "http://a:1", "http://b:2", "--model", "x", "y"])
    assert [t.model for t in bench_serving.targets(args)] == ["x", "y"]
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--base-url", "http://a:1", "http://b:2", "--model", "x", "y", "z"])
    header = bench_serving.table(
        [{**_summary(), "target": "a:1"}, {**_summary(), "target": "b:2"}]
    ).splitlines()[0]
    assert header.split("|")[1:] == [" a:1 @ inf ", " b:2 @ inf"]


def _summary() -> dict[str, object]:
    result = bench_serving.RequestResult(
        success=True, prompt_tokens=1, output_tokens=2, ttft=0.1, latency=0.2
    )
    summary: dict[str, object] = bench_serving.summarize([result], duration=1.0, rate=float("inf"))
    return summary


def test_shared_prefix_requests_interleave_the_system_prompts() -> None:
    """shared-prefix: each round of 8 requests uses each of the 8 system prompts once, in a shuffled order, then a
    distinct short question."""
    args = bench_serving.parse_args(
        [
            "--model",
            "m",
            "--dataset",
            "shared-prefix",
            "--num-prompts",
            "20",
            "--num-prefixes",
            "8",
            "--prefix-len",
            "512",
            "--input-len",
            "12",
        ]
    )
    requests = bench_serving.make_requests(args, random.Random(0))
    systems = [r.prompt.split("\n\n", 1)[0] for r in requests]
    questions = [r.prompt.split("\n\n", 1)[1] for r in requests]
    assert len(set(systems)) == 8 and all(len(system.split()) == 512 for system in systems)
    assert all(len(set(systems[start : start + 8])) == 8 for start in (0, 8))
    # Not a fixed turn: some system prompt comes at both an even and an odd position, so round robin over two
    # replicas computes it on both (a fixed turn would pin prompt k to replica k mod 2, like prefix routing).
    assert any(len({i % 2 for i in range(20) if systems[i] == system}) == 2 for system in set(systems))
    assert len(set(questions)) == 20
    assert all(len(q.split()) == 2 + 12 for q in questions)  # "Question i:" then --input-len words
    assert all(r.max_tokens == 128 for r in requests)


def test_prefix_cache_counters_are_summed_over_series_and_namespaces() -> None:
    """/metrics counters: any `namespace:` prefix, one series per replica summed; other names ignored."""
    exposition = "\n".join(
        [
            "# HELP pagoda:prefix_cache_hits_total Prompt tokens served by the prefix cache.",
            "# TYPE pagoda:prefix_cache_hits_total counter",
            'pagoda:prefix_cache_hits_total{engine="0",model_name="m"} 30.0',
            'pagoda:prefix_cache_hits_total{engine="1",model_name="m"} 12.0',
            'pagoda:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9',
            'vllm:prefix_cache_queries_total{model_name="m x"} 100.0',
            'pagoda:gpu_prefix_cache_hits_total{model_name="m"} 999.0',
        ]
    )
    assert bench_serving.counter_sum(exposition, "prefix_cache_hits_total") == 42.0
    assert bench_serving.counter_sum(exposition, "prefix_cache_queries_total") == 100.0
    assert bench_serving.counter_sum(exposition, "num_preemptions_total") is None
    summary = bench_serving.prefix_cache_summary((100.0, 10.0), (300.0, 160.0))
    assert summary == {
        "prefix_cache_queries": 200.0,
        "prefix_cache_hits": 150.0,
        "prefix_cache_hit_rate": 0.75,
    }
    assert bench_serving.prefix_cache_summary(None, (1.0, 1.0))["prefix_cache_hit_rate"] is None
    assert bench_serving.prefix_cache_summary((5.0, 1.0), (5.0, 1.0))["prefix_cache_hit_rate"] is None


def test_labelled_servers_compare_hit_rates_in_one_table() -> None:
    """--label names the columns; the hit-rate row shows a percentage, or n/a for a server without counters."""
    args = bench_serving.parse_args(
        ["--base-url", "http://a:1", "http://b:2", "--model", "m", "--label", "cache_aware", "round_robin"]
    )
    assert [t.label for t in bench_serving.targets(args)] == ["cache_aware", "round_robin"]
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--base-url", "http://a:1", "--model", "m", "--label", "x", "y"])
    runs = [
        {**_summary(), "target": "cache_aware", "prefix_cache_hit_rate": 0.875},
        {**_summary(), "target": "round_robin", "prefix_cache_hit_rate": None},
    ]
    row = next(line for line in bench_serving.table(runs).splitlines() if line.startswith("Prefix cache"))
    assert [cell.strip() for cell in row.split("|")[1:]] == ["87.5%", "n/a"]


def test_settle_waits_for_idle_cpus_and_no_longer_than_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """settle returns once a window is idle, keeps sampling while the CPUs are busy, and gives up at its cap;
    cpu_busy_fraction reads a share in [0, 1] from /proc/stat (None where there is none)."""
    used = bench_serving.cpu_busy_fraction(0.05)
    assert used is None or 0.0 <= used <= 1.0
    readings = iter([0.9, 0.5, 0.02])
    monkeypatch.setattr(bench_serving, "cpu_busy_fraction", lambda window: next(readings))
    bench_serving.settle(60.0)
    with pytest.raises(StopIteration):  # it stopped at the idle reading, the third
        next(readings)

    def busy(window: float) -> float:
        time.sleep(0.02)
        return 1.0

    monkeypatch.setattr(bench_serving, "cpu_busy_fraction", busy)
    assert 0.1 <= bench_serving.settle(0.1) < 1.0
    assert bench_serving.settle(0.0) < 0.05


def test_burstiness_shapes_the_gaps_and_one_is_poisson() -> None:
    """vLLM's --burstiness: gamma gaps with mean 1 / rate and coefficient of variation 1 / sqrt(shape); shape 1
    draws exactly the exponential gaps seeded runs drew before."""
    rate, n = 4.0, 20_000
    poisson = [bench_serving.arrival_gap(random.Random(3), rate) for _ in range(1)]
    assert poisson == [random.Random(3).expovariate(rate)]
    for shape in (0.5, 1.0, 4.0):
        rng = random.Random(7)
        gaps = [bench_serving.arrival_gap(rng, rate, shape) for _ in range(n)]
        mean = sum(gaps) / n
        sd = (sum((g - mean) ** 2 for g in gaps) / n) ** 0.5
        # The sample mean's standard error is (1 / rate) / sqrt(shape * n): 5 of them (and 5% on the CV).
        assert abs(mean - 1 / rate) < 5 * (1 / rate) / (shape * n) ** 0.5
        assert abs(sd / mean - shape**-0.5) < 0.05 * shape**-0.5


def test_goodput_counts_the_requests_meeting_every_objective() -> None:
    """Of four requests over 2 s, two meet ttft <= 100 ms and tpot <= 20 ms: goodput 1 req/s; without
    objectives there is none."""

    def result(ttft: float, latency: float, tokens: int = 11) -> bench_serving.RequestResult:
        return bench_serving.RequestResult(
            success=True, prompt_tokens=4, output_tokens=tokens, ttft=ttft, latency=latency
        )

    results = [
        result(0.05, 0.05 + 10 * 0.015),  # meets both
        result(0.09, 0.09 + 10 * 0.019),  # meets both, just within
        result(0.20, 0.20 + 10 * 0.010),  # ttft missed
        result(0.05, 0.05 + 10 * 0.030),  # tpot missed
        bench_serving.RequestResult(error="HTTP 500"),
    ]
    summary = bench_serving.summarize(results, 2.0, float("inf"), {"ttft": 100.0, "tpot": 20.0})
    assert summary["request_goodput"] == pytest.approx(1.0)
    assert bench_serving.summarize(results, 2.0, float("inf"))["request_goodput"] is None
    # End-to-end 0.2, 0.28, 0.3 and 0.35 s: three within 310 ms.
    e2el = bench_serving.summarize(results, 2.0, float("inf"), {"e2el": 310.0})
    assert e2el["request_goodput"] == pytest.approx(1.5)
