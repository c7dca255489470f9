"""`pagoda bench serve | throughput | latency` (vLLM's flag names): a live tiny server and a tiny model, their
printed results, JSON and PNG; the statistics against numpy; bad flags exit 2 naming the flag."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from pagoda.server.bench.serve_cli import metric_stats, percentile
from pagoda.server.cli import main
from pagoda.server.testing import LiveServer, make_tiny_model

MODEL = "tiny"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The engine flags of the offline runs: small and exact.
TINY_ENGINE = ["--dtype", "float32", "--kv-cache-gib", "0.01", "--max-model-len", "64"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama folder for the module."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    """One live tiny server for the module."""
    flags = ["--dtype", "float32", "--kv-cache-gib", "0.05", "--max-model-len", "256"]
    with LiveServer(tiny_model, flags, served_model_name=MODEL) as live:
        yield live


def test_bench_serve_prints_vllm_results_and_saves_json_and_png(server: LiveServer, tmp_path: Path) -> None:
    """A few prompts against the live server: the result block, a progress bar, the JSON (vLLM's keys, the
    percentiles asked for, token counts that EOS ignored makes exact) and a PNG beside it."""
    num_prompts, output_len = 4, 4
    done = subprocess.run(
        [
            sys.executable, "-m", "pagoda.server.cli", "bench", "serve", "--base-url", server.base_url,
            "--num-prompts", str(num_prompts), "--random-input-len", "8", "--random-output-len", str(output_len),
            "--ignore-eos", "--temperature", "0", "--max-concurrency", "2", "--save-result", "--save-detailed",
            "--result-dir", str(tmp_path), "--result-filename", "run.json", "--metric-percentiles", "50,99.9",
            "--metadata", "machine=ci", "--goodput", "e2el:600000", "--burstiness", "0.5",
        ],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Serving Benchmark Result" in done.stdout
    assert f"Successful requests:                     {num_prompts}" in done.stdout
    assert "P99.9 TTFT (ms):" in done.stdout and "Maximum request concurrency:             2" in done.stdout
    assert f"{num_prompts}/{num_prompts}" in done.stderr  # tqdm's bar, at its end
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["model_id"] == MODEL and result["backend"] == "vllm" and result["machine"] == "ci"
    assert "Request goodput (req/s):" in done.stdout
    assert result["burstiness"] == 0.5 and result["request_goodput"] > 0
    assert (result["completed"], result["failed"]) == (num_prompts, 0)
    assert result["total_output_tokens"] == num_prompts * output_len
    assert result["output_lens"] == [output_len] * num_prompts
    for name in ("ttft", "tpot", "itl"):
        assert 0.0 < result[f"median_{name}_ms"] <= result[f"p99.9_{name}_ms"]
        assert f"p50_{name}_ms" in result and f"std_{name}_ms" in result
    assert "mean_e2el_ms" not in result  # not in --percentile-metrics' default
    assert (tmp_path / "run.png").read_bytes().startswith(PNG_MAGIC)


def test_bench_serve_finds_the_model_and_names_its_file(server: LiveServer, tmp_path: Path) -> None:
    """No --model: the first /v1/models id is sent; the chat backend labels the file, in vLLM's pattern."""
    status = main(
        [
            "bench", "serve", "--host", "127.0.0.1", "--port", server.base_url.rsplit(":", 1)[1],
            "--backend", "openai-chat", "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2",
            "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--request-rate", "50",
        ]
    )  # fmt: skip
    assert status == 0
    (path,) = tmp_path.glob("*.json")
    assert path.name.startswith(f"openai-chat-50qps-{MODEL}-") and path.with_suffix(".png").is_file()
    assert json.loads(path.read_text())["completed"] == 2


def test_percentiles_and_stats_match_numpy() -> None:
    """The percentiles are numpy's linear ones; TPOT excludes the first token; std is the population's."""
    rng = random.Random(0)
    for size in (1, 2, 7, 100):
        values = [rng.uniform(0.0, 10.0) for _ in range(size)]
        for p in (1.0, 50.0, 90.0, 99.0, 99.9, 100.0):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-12)
    requests = [
        {"success": True, "ttft": 0.1, "latency": 0.4, "output_tokens": 4, "itl": [0.1, 0.1, 0.1]},
        {"success": True, "ttft": 0.3, "latency": 0.3, "output_tokens": 1, "itl": []},
        {"success": False, "ttft": 0.0, "latency": 0.0, "output_tokens": 0, "itl": []},
    ]
    args = SimpleNamespace(percentile_metrics=("ttft", "tpot", "e2el"), metric_percentiles=(50.0,))
    stats = metric_stats({"requests": requests}, args)  # type: ignore[arg-type]
    assert stats["mean_ttft_ms"] == pytest.approx(200.0)
    assert stats["std_ttft_ms"] == pytest.approx(100.0)  # population std of 100 and 300 ms
    assert stats["mean_tpot_ms"] == pytest.approx(100.0)  # (400 - 100) / 3; the one-token request has none
    assert stats["p50_e2el_ms"] == pytest.approx(350.0)


def test_bench_throughput_and_latency_on_a_tiny_model(tiny_model: Path, tmp_path: Path) -> None:
    """Offline runs with the engine's flags: exact token counts (EOS ignored), vLLM's JSON keys, and PNGs."""
    throughput = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", str(tiny_model), *TINY_ENGINE, "--num-prompts", "4"]
    assert main([*argv, "--input-len", "8", "--output-len", "3", "--output-json", str(throughput)]) == 0
    result = json.loads(throughput.read_text())
    assert (result["num_requests"], result["total_prompt_tokens"], result["total_output_tokens"]) == (
        4,
        32,
        12,
    )
    assert result["total_num_tokens"] == 44
    assert result["tokens_per_second"] == pytest.approx(44 / result["elapsed_time"])
    assert throughput.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)
    latency = tmp_path / "latency.json"
    argv = [
        "bench",
        "latency",
        "--model",
        str(tiny_model),
        *TINY_ENGINE,
        "--batch-size",
        "2",
        "--input-len",
        "4",
    ]
    argv += [
        "--output-len",
        "2",
        "--num-iters-warmup",
        "1",
        "--num-iters",
        "3",
        "--output-json",
        str(latency),
    ]
    assert main(argv) == 0
    result = json.loads(latency.read_text())
    assert len(result["latencies"]) == 3 and set(result["percentiles"]) == {
        "10",
        "25",
        "50",
        "75",
        "90",
        "99",
    }
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 3)
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])
    assert latency.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["bench", "serve", "--num-prompts", "0"], "--num-prompts"),
        (["bench", "serve", "--request-rate", "0"], "--request-rate"),
        (["bench", "serve", "--random-range-ratio", "1.5"], "--random-range-ratio"),
        (["bench", "serve", "--percentile-metrics", "ttft,speed"], "--percentile-metrics"),
        (["bench", "serve", "--metric-percentiles", "0"], "--metric-percentiles"),
        (["bench", "serve", "--dataset-name", "sharegpt"], "--dataset-path"),
        (["bench", "serve", "--dataset-name", "sonnet"], "--dataset-name"),
        (
            ["bench", "serve", "--input-len", "8"],
            "--input-len",
        ),  # the tool's name; vLLM's is --random-input-len
        (["bench", "throughput", "--max-num-seqs", "0"], "--max-num-seqs"),
        (["bench", "throughput", "--quantization", "int8", "--model", "gemma3-270m"], "--quantization"),
        (["bench", "latency", "--num-iters", "0"], "--num-iters"),
        (["bench", "latency", "--batch-size", "x"], "--batch-size"),
        (["bench", "nothing"], "nothing"),
        (["bench", "serve", "--burstiness", "0"], "--burstiness"),
        (["bench", "serve", "--goodput", "ttft"], "--goodput"),
        (["bench", "serve", "--goodput", "itl:50"], "--goodput"),
        (["bench", "serve", "--goodput", "tpot:-1"], "--goodput"),
    ],
)
def test_bad_bench_flags_exit_2_naming_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse's exit 2 (or the engine config's, as `pagoda serve` words it), before any model loads."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err
